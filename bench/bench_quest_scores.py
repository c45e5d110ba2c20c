"""Quest page upper-bound logits on one GPU: the Triton kernel against the torch sequence it replaced.

One layer's scoring in the Llama-3.1-8B attention shape (8 KV heads, G = 4, D = 128), one decode token,
bounds in bf16 (``[Hkv, 2D, U]``, U = context / 16 pages): at 128k context 33.5 MB of bounds, read once.
For each context it times the torch reference (cat of the clamps, cast, bmm, permute, float, scale) and
the kernel under the default ``QuestScoresConfig``, and with ``--sweep`` a grid of configs; each timing is
the median over repetitions, each after a 256 MiB write that evicts L2 (the bounds fit in the H100's 50 MB
L2, which a decode step's other layers would have flushed) and a GPU sleep that keeps launch overhead off
the clock. Bandwidth counts bounds read + logits written; a device-to-device copy (read + written) is the
ceiling it is compared with.

Usage: ``python bench/bench_quest_scores.py [--sweep] [--contexts 32768 131072] [--dtype bf16|fp32]``
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from workers.kernels.quest_scores import DEFAULT_QUEST_SCORES, QuestScoresConfig, quest_upper_bounds

HKV, G, D, PAGE = 8, 4, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SCALE = D**-0.5


def timed(fn, flush: torch.Tensor, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of ``fn`` on the GPU, L2 flushed before each call."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(1_000_000)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))[reps // 2]


def copy_gbs(flush: torch.Tensor) -> float:
    """Device-to-device copy bandwidth (bytes read + written), GB/s."""
    x = torch.empty(1 << 30, dtype=torch.int8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), flush) / 1e3


def configs(sweep: bool) -> list[QuestScoresConfig]:
    if not sweep:
        return [DEFAULT_QUEST_SCORES]
    grid = itertools.product((32, 64, 128, 256), (32, 64), (4, 8), (2, 3, 4))
    return [QuestScoresConfig(block_u=u, block_k=k, num_warps=w, num_stages=s) for u, k, w, s in grid]


def bench_context(ctx: int, tokens: int, dtype: torch.dtype, sweep: bool, flush: torch.Tensor) -> None:
    """Time the torch path and the kernel configs at one context; print the ten fastest configs."""
    u = ctx // PAGE
    q = torch.randn(tokens, HKV, G, D, device="cuda", dtype=dtype)
    kb = torch.randn(HKV, 2 * D, u, device="cuda", dtype=dtype)
    moved = kb.numel() * kb.element_size() + tokens * HKV * G * u * 4
    ref = quest_upper_bounds(q, kb, SCALE, use_triton=False)
    t = timed(functools.partial(quest_upper_bounds, q, kb, SCALE, use_triton=False), flush)
    print(f"ctx {ctx}: {moved / 1e6:.1f} MB; torch {t:.1f} us ({moved / t / 1e3:.0f} GB/s)")
    rows = []
    for cfg in configs(sweep):
        run = functools.partial(quest_upper_bounds, q, kb, SCALE, use_triton=True, config=cfg)
        err = ((run() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
        rows.append((timed(run, flush), cfg, err))
    for t, cfg, err in sorted(rows, key=lambda r: r[0])[:10]:
        print(f"  triton {t:6.1f} us ({moved / t / 1e3:4.0f} GB/s) max rel err {err:.1e}  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tokens", type=int, default=1, help="decode tokens T scored at once")
    ap.add_argument("--sweep", action="store_true", help="time a grid of kernel configs")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs(flush):.0f} GB/s (read + written)")
    for ctx in args.contexts:
        bench_context(ctx, args.tokens, DTYPES[args.dtype], args.sweep, flush)


if __name__ == "__main__":
    main()
