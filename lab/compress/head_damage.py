"""Rank KV heads by what pruning each one costs the model (issue 15: which heads HybridKV must not prune).

``python -m lab.compress.head_damage --docs 5 --length 1024`` takes the calibration documents HybridKV's
``head_select`` uses (training split: the same tasks and seeds). For each document it runs the reconstruction
prompt + the repeated context (teacher forcing, ``workers.methods.reconstruct``'s inputs) over the stored
context, once as is and once per (layer, KV head) with that head's context removed (its query heads attend
only the repeat's own tokens: HybridKV's pruned head). A head's damage is the mean increase of the repeat's
token NLL (nats); with ``--objective answer``, of the sample's gold answer after its query instead. Prints the
heads by damage and the top half as a ranking (JSON). Not the paper's statistic: a check of which heads the
model needs, to compare with ``hybridkv_heads.json``'s (``lab/notes/hybridkv_vt.md``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

from lab.compress.head_select import CALIBRATION_SEED, CALIBRATION_TASKS
from lab.synth import SynthContext, generate
from workers.attention import STEP_KWARG, merge_attention
from workers.kernels.dense_attention import dense_attention
from workers.methods.reconstruct import reconstruction_inputs
from workers.model import load_model
from workers.prefill import prefill_kv


class _DropStep:
    """Attention over the stored context + the chunk, with one KV head's context left out (None: none)."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], drop: tuple[int, int] | None):
        self.kv, self.drop = kv, drop

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ck, cv = self.kv[layer]
        o_ctx, lse_ctx = dense_attention(q, ck[None], cv[None], scale)
        o_own, lse_own = dense_attention(q, k, v, scale, q_offset=0)
        if self.drop is not None and self.drop[0] == layer:
            g = q.shape[1] // ck.shape[0]
            h = self.drop[1]
            lse_ctx = lse_ctx.clone()
            lse_ctx[:, h * g:(h + 1) * g] = -float("inf")  # the head's context weighs nothing
        out, _ = merge_attention(o_ctx, lse_ctx, o_own, lse_own)
        return out.to(q.dtype)


@torch.inference_mode()
def _nll_after(lm: Any, n_ctx: int, lead: list[int], target: list[int],
               kv: Sequence[tuple[torch.Tensor, torch.Tensor]], drop: tuple[int, int] | None) -> float:
    """Mean NLL of ``target``'s tokens after ``lead``, both placed after the stored context of ``n_ctx`` tokens."""
    x = lead + target
    pos = torch.arange(n_ctx, n_ctx + len(x))[None]
    hidden = lm.model.get_decoder()(input_ids=torch.tensor([x]), position_ids=pos, use_cache=False,
                                    **{STEP_KWARG: _DropStep(kv, drop)}).last_hidden_state
    logits = lm.model.lm_head(hidden[0, len(lead) - 1:-1]).float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(target)))


def repeat_nll(lm: Any, ids: list[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
               drop: tuple[int, int] | None) -> float:
    """Mean NLL of the repeated context's tokens given the reconstruction prompt (one chunk)."""
    prompt, repeat = reconstruction_inputs(lm, ids)
    return _nll_after(lm, len(ids), prompt, repeat, kv, drop)


def answer_nll(lm: Any, ids: list[int], rest: tuple[list[int], list[int]],
               kv: Sequence[tuple[torch.Tensor, torch.Tensor]], drop: tuple[int, int] | None) -> float:
    """Mean NLL of the gold answer's tokens after the query (``--objective answer``)."""
    query, target = rest
    return _nll_after(lm, len(ids), query, target, kv, drop)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/kvstash-tiny")
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--objective", choices=("repeat", "answer"), default="repeat",
                   help="repeat: the reconstruction's NLL; answer: the gold answer's NLL after the sample's query "
                        "(training-split samples of head_select's calibration tasks)")
    args = p.parse_args(argv)
    lm = load_model(args.model, dtype="float32", progress=False)
    n_l, n_h = lm.layout.n_layers, lm.layout.n_kv_heads
    damage = torch.zeros(n_l, n_h)
    base_all = []
    ctx = SynthContext(tokenizer=lm.tokenizer, split="train")
    for i in range(args.docs):
        sample = generate(CALIBRATION_TASKS[i % len(CALIBRATION_TASKS)], args.length, CALIBRATION_SEED + i, ctx)
        ids = list(lm.tokenizer(sample.document).input_ids)
        kv = [(k.float(), v.float()) for _, k, v in prefill_kv(lm, ids, progress=False)]
        rest = (list(lm.tokenizer(sample.query, add_special_tokens=False).input_ids),
                list(lm.tokenizer(sample.target, add_special_tokens=False).input_ids))

        def nll(drop: tuple[int, int] | None, ids: list[int] = ids, kv: Any = kv, rest: Any = rest) -> float:
            return repeat_nll(lm, ids, kv, drop) if args.objective == "repeat" else answer_nll(lm, ids, rest, kv, drop)
        base = nll(None)
        base_all.append(base)
        for layer in range(n_l):
            for h in range(n_h):
                damage[layer, h] += (nll((layer, h)) - base) / args.docs
    order = sorted(((float(damage[layer, h]), f"L{layer}H{h}") for layer in range(n_l) for h in range(n_h)),
                   reverse=True)
    print(json.dumps({"args": vars(args), "base_nll": base_all, "damage": [[round(float(x), 4) for x in r]
                      for r in damage], "by_damage": order, "top_half": [nm for _, nm in order[:n_l * n_h // 2]]}))


if __name__ == "__main__":
    main()
