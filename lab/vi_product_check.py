"""The product path's sparse attention, layer by layer, against dense attention and (``topk+vi``) against the float64
merge of exactly what each step read (``lab/notes/phi_value_estimators.md``, last section).

Answers a synthetic-suite sample through a ``Worker`` over a store as ``kvstash eval`` does (stored prefix, engine,
page fetcher, raw query; any device) and wraps ``SparsePrefixAttention.attend`` to measure, per layer and kind of
row (the query's rows / decode rows), the rel. L1 error (eq. 53) of the prefix output against

- ``dense``: full attention over the stored K/V;
- ``merge`` (``topk+vi`` only): the float64 definition of the step (exact softmax over the anchors and the mid tokens
  read, plus one pseudo-entry of the unread ones from the indexes; the read set is the one the step handed its
  completion). 0 up to rounding when the step computes what it means to; a large value is a bug of the step.

Steps replayed from a CUDA graph run no Python, so they are not measured: ``--eager`` turns the graphs off.

    OMP_NUM_THREADS=1 python -m lab.vi_product_check --task compare --length 16384 --samples 8,10 \\
        --method topk --method topk+vi --device cuda --eager --output check.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import torch

from lab.phi_diagnose import rel_l1
from workers.attention import dense_attention
from workers.methods.key_index import dequantize_keys
from workers.methods.sparse import SparsePrefixAttention
from workers.methods.value_index import IndexCompletion, merged_ref, remainder_mask


class Probe:
    """Wraps the product's attention and completion; collects errors by (method, check, layer, row kind)."""

    def __init__(self) -> None:
        self.method = ""
        self.errors: dict[tuple[str, str, int, str], list[torch.Tensor]] = defaultdict(list)
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._index: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rem: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        """Per layer, this call's remainder masks (one per chunk of rows) and mid region."""

    def install(self) -> None:
        """Patch ``SparsePrefixAttention.attend`` and ``IndexCompletion.term`` (this process only)."""
        attend, term = SparsePrefixAttention.attend, IndexCompletion.term
        probe = self

        def attend_probed(attn: SparsePrefixAttention, layer: int, q: torch.Tensor, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
            probe._rem.pop(layer, None)
            out, lse = attend(attn, layer, q, scale)
            probe.measure(attn, layer, q, scale, out)
            return out, lse

        def term_probed(comp: IndexCompletion, layer: int, ctx: Any, q: torch.Tensor, scale: float, *args: Any,
                        **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
            res = term(comp, layer, ctx, q, scale, *args, **kw)
            tokens, valid = kw["tokens"], kw.get("valid")
            if valid is None:  # as term does: the first counts entries are valid
                valid = torch.arange(tokens.shape[-1], device=tokens.device) < args[2].unsqueeze(-1)
            probe._rem.setdefault(layer, []).append((remainder_mask(ctx, tokens, valid), ctx.lo, ctx.hi))
            return res

        setattr(SparsePrefixAttention, "attend", attend_probed)  # noqa: B010 - a patch, typed loosely on purpose
        setattr(IndexCompletion, "term", term_probed)  # noqa: B010

    def measure(self, attn: SparsePrefixAttention, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor
                ) -> None:
        """Errors of one call's output against dense attention and, where the completion ran, the float64 merge."""
        kind = "query" if q.shape[2] > 1 else "decode"
        key = (id(attn.source), layer)
        if key not in self._kv:
            self._kv[key] = tuple(x.to(q.device) for x in attn.source.layer_kv(layer))  # type: ignore[assignment]
        k, v = self._kv[key]
        ref, _ = dense_attention(q.float(), k.float()[None], v.float()[None], scale)
        self.errors[(self.method, "dense", layer, kind)].append(rel_l1(out.double(), ref.double()).flatten().cpu())
        if layer in self._rem:
            parts = self._rem[layer]
            rem, (_, lo, hi) = torch.cat([r for r, _, _ in parts]), parts[0]
            keys, values = self._indexes(attn, layer, lo, hi)
            m, _ = merged_ref(q, k, v, keys, values, ~rem, lo, hi, scale)
            self.errors[(self.method, "merge", layer, kind)].append(rel_l1(out.double(), m).flatten().cpu())

    def _indexes(self, attn: SparsePrefixAttention, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value indexes' mid tokens of ``layer``, float64 (read once per prefix and layer)."""
        key = (id(attn.source), layer)
        if key not in self._index:
            got = []
            for name in ("keyindex", "valueindex"):
                a = attn.source.artifact(name)
                bits, block = (int(x) for x in a["0.meta"][:2])
                got.append(dequantize_keys(a[f"{layer}.codes"], a[f"{layer}.lo"], a[f"{layer}.step"], bits, block,
                                           lo, hi, dtype=torch.float64))
            self._index[key] = (got[0], got[1])
        return self._index[key]

    def summary(self) -> dict[str, float]:
        """Mean error per (method, check, layer, row kind)."""
        return {" ".join(map(str, k)): round(float(torch.cat(x).mean()), 5) for k, x in sorted(self.errors.items())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Answer each sample with each method through the product (a worker over a store); errors and answers."""
    import tempfile
    from pathlib import Path

    from lab.eval.accuracy import EVAL_SEED_BASE
    from lab.synth import SynthContext, generate
    from store.config import StoreConfig
    from store.kvstore import KVStore
    from workers.decode_batch import EngineConfig
    from workers.engine import Worker
    from workers.model import load_model
    from workers.model_source import default_model
    from workers.requests import DecodeConfig, SamplingParams

    probe = Probe()
    probe.install()
    lm = load_model(args.model or default_model(), device=args.device, progress=False)
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="kvstash-vi-check-"))
    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size))
    # --eager: graph replays run no Python, so a captured step could not be measured
    worker = Worker(store, lm, progress=False, engine=EngineConfig(cuda_graphs=not args.eager))
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    answers = []
    for i in args.samples:
        sample = generate(args.task, args.length, EVAL_SEED_BASE + i, ctx)
        prefix = worker.prefill(sample.document).prefix_id
        for name in args.method:
            probe.method = name
            text = "".join(worker.generate(prefix, sample.query, greedy, method=name,
                                           decode=DecodeConfig(budget=args.budget), raw=True))
            answers.append({"index": i, "method": name, "text": text, "score": sample.score(text)})
            print(json.dumps(answers[-1]), flush=True)
    store.close()
    return {"args": vars(args), "answers": answers, "errors": probe.summary()}


def main(argv: list[str] | None = None) -> None:
    """Command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--samples", type=lambda s: [int(x) for x in s.split(",")], required=True)
    p.add_argument("--method", action="append", required=True, help="sparse methods (repeatable)")
    p.add_argument("--budget", type=float, default=0.01)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the shipped model)")
    p.add_argument("--home", default=None, help="data directory (prefixes kept across runs)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (every step measured)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    result = run(args)
    for k, x in result["errors"].items():
        print(k, x)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
