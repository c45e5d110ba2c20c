"""Time of one decode step of one layer through each method's sparse path (selection + attention).

Llama-3.1-8B attention shape (8 KV heads x G=4, D=128), bf16, one query token, summaries
built once. Prints per-method medians and the ratio to exact attention over the whole context
(``dense_attention``) and to SDPA over it. Meant for a GPU (CUDA events); runs on CPU too. The per-step
selection methods only: compressed and query-time caches need a stored prefix (bench them through the worker).

    python3 bench/bench_sparse_step.py --ctx 32768 --budget 0.02
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timed  # noqa: E402
from workers.attention import dense_attention  # noqa: E402
from workers.methods.memory import MemorySource  # noqa: E402
from workers.methods.registry import METHODS, QUERY_TIME, compression_methods, get_method  # noqa: E402
from workers.requests import DecodeConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hkv, g, d = 8, 4, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(hkv, args.ctx, d, generator=gen).to(dev, dtype)
    v = torch.randn(hkv, args.ctx, d, generator=gen).to(dev, dtype)
    q = torch.randn(1, hkv * g, 1, d, generator=gen).to(dev, dtype)
    scale = d ** -0.5
    summarizers = {s for m in METHODS.values() for s in m.summarizers}
    t0 = time.perf_counter()
    src = MemorySource.build([(k, v)], summarizers)
    print(f"device {dev}, ctx {args.ctx}, budget {args.budget}, summaries built in {time.perf_counter() - t0:.2f} s")
    full = timed(lambda: dense_attention(q, k[None], v[None], scale), args.reps, dev)
    sdpa = timed(lambda: F.scaled_dot_product_attention(q, k[None], v[None], scale=scale, enable_gqa=True),
                 args.reps, dev)
    print("| method | step ms | / dense_attention | / SDPA full | exact tokens/KV head |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| full (dense_attention) | {full * 1e3:.3f} | 1.00 | {full / sdpa:.2f} | {args.ctx} |")
    # Compressed and query-time caches are built from a stored prefix and its query (the worker's path):
    # not a per-step selection over in-memory K/V.
    for name in sorted(set(METHODS) - set(compression_methods()) - QUERY_TIME - {"full"}):
        attn = get_method(name).open(src, DecodeConfig(budget=args.budget))
        attn.attend(0, q, scale)
        t = timed(lambda a=attn: a.attend(0, q, scale), args.reps, dev)
        reads = attn.read_report().tokens_per_step[-1] / hkv
        print(f"| {name} | {t * 1e3:.3f} | {t / full:.2f} | {t / sdpa:.2f} | {reads:.0f} |")


if __name__ == "__main__":
    main()
