"""One compressed cache, another question: SnapKV's keep set chosen with query 1 and asked query 2, vs KVzip.

SnapKV picks the prefix entries the *query* attends; a cache meant to serve many queries is built once,
with whatever query came first. On niah_multikey samples (four keys, each hiding a number) query 1 asks
for the first key's number and query 2 for another key's. Per sample and at one kept fraction
``ratio`` (SnapKV keeps ``ratio * n_tokens`` entries per KV head; KVzip keeps ``ratio`` of all KV pairs):

- ``full``: exact attention, query 2;
- ``snapkv same``: SnapKV compressed with query 2 itself (the single-query setting: query 2's tokens attend
  the whole prefix, the answer's the entries they kept);
- ``snapkv other``: SnapKV compressed with query 1 (its tokens attend the whole prefix once), then asked
  query 2 over the kept entries (the multi-query setting: the next query sees only the compressed cache);
- ``kvzip``: KVzip's query-agnostic cache, asked query 2.

Greedy decoding over the kept entries through the model's attention hook (``PREFIX_KWARG``), the same
attention objects the worker uses (``QueryTimeAttention``, ``CompressedPrefixAttention``).

    python -m bench.bench_cross_query --length 4096 --ratio 0.1 --samples 10
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence

import torch

from lab.eval.accuracy import EVAL_SEED_BASE
from lab.eval.intervals import wilson
from lab.synth import PROMPT, SynthContext, generate
from lab.synth.niah import question_text
from lab.synth.sample import ruler_score
from workers.attention import PREFIX_KWARG, PrefixAttention
from workers.methods.compressed import CompressedPrefixAttention, compact_cache
from workers.methods.keep_set import KeepConfig, QueryTimeAttention
from workers.methods.kvzip import KVzip
from workers.methods.memory import MemorySource
from workers.model import LoadedModel, load_model
from workers.prefill import prefill_kv

NEEDLE = re.compile(r"One of the special magic numbers for (.+?) is: (\d+)\.")
MAX_NEW = 24


@torch.inference_mode()
def forward(lm: LoadedModel, attn: PrefixAttention, ids: list[int], start: int, max_new: int) -> list[int]:
    """Feed ``ids`` at positions from ``start`` over the prefix ``attn``; greedy tokens (none when max_new is 0)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    out: list[int] = []
    feed, pos = ids, start
    while True:
        p = torch.arange(pos, pos + len(feed))[None]
        logits = lm.model(input_ids=torch.tensor([feed]), position_ids=p, past_key_values=cache, use_cache=True,
                          logits_to_keep=1, **{PREFIX_KWARG: attn}).logits
        if feed is ids and hasattr(attn, "query_done"):
            attn.query_done(None, pos + len(feed))  # type: ignore[arg-type]  # SnapKV's scorer uses no own K/V
        if len(out) >= max_new:
            return out
        nxt = int(logits[0, -1].argmax())
        if nxt in lm.eos_ids:
            return out
        out.append(nxt)
        pos += len(feed)
        feed = [nxt]


def query_ids(lm: LoadedModel, query: str) -> list[int]:
    """Token ids of an already formatted query (``raw``, as the eval sends it)."""
    return list(lm.tokenizer(query, add_special_tokens=False).input_ids)


def snapkv(source: MemorySource, budget: int, observed: list[int], lm: LoadedModel, start: int) -> PrefixAttention:
    """A SnapKV cache of ``budget`` entries per KV head, chosen by the query ``observed``."""
    attn = QueryTimeAttention(source, KeepConfig(budget_tokens=budget), observe_query=True)
    forward(lm, attn, observed, start, 0)
    return attn


def run_sample(lm: LoadedModel, ctx: SynthContext, length: int, seed: int, ratio: float) -> dict[str, float]:
    """Scores of query 2 under each cache for one sample."""
    sample = generate("niah_multikey", length, seed, ctx)
    needles = NEEDLE.findall(sample.document)
    key2, value2 = next((k, v) for k, v in needles if v not in sample.answers)
    q1 = query_ids(lm, sample.query)
    q2 = query_ids(lm, PROMPT.query(question_text("number", [key2], False)))
    ids = list(lm.tokenizer(sample.document).input_ids)
    kv = [(k, v) for _, k, v in prefill_kv(lm, ids, progress=False)]
    n = len(ids)
    budget = max(1, math.ceil(ratio * n))
    method = KVzip()
    keep = method.keep(method.score(lm, ids, kv), ratio, len(kv), kv[0][0].shape[0], n)
    source = MemorySource(kv, {})
    caches: dict[str, PrefixAttention] = {
        "full": CompressedPrefixAttention(source, compact_cache(torch.ones_like(keep), kv)),
        "snapkv same": QueryTimeAttention(MemorySource(kv, {}), KeepConfig(budget_tokens=budget), observe_query=True),
        "snapkv other": snapkv(MemorySource(kv, {}), budget, q1, lm, n),
        "kvzip": CompressedPrefixAttention(source, compact_cache(keep, kv)),
    }
    text = {name: lm.tokenizer.decode(forward(lm, attn, q2, n, MAX_NEW)) for name, attn in caches.items()}
    return {name: ruler_score(t, (value2,)) for name, t in text.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/kvstash-tiny")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--output", help="also write the JSON result here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model, dtype="float32", progress=False)
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    scores: dict[str, list[float]] = {}
    for i in range(args.samples):
        for name, s in run_sample(lm, ctx, args.length, EVAL_SEED_BASE + i, args.ratio).items():
            scores.setdefault(name, []).append(s)
        print(f"sample {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in scores.items()), flush=True)
    rows = {k: {"accuracy": sum(v) / len(v), "interval": wilson(sum(v), len(v)), "samples": len(v)}
            for k, v in scores.items()}
    print(json.dumps({"length": args.length, "ratio": args.ratio, "rows": rows}, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"length": args.length, "ratio": args.ratio, "rows": rows, "scores": scores}, f, indent=1)


if __name__ == "__main__":
    main()
