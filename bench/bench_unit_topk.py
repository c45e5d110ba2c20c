"""Page selection on one GPU: ``group_top_units`` (one launch) against the torch path it replaced.

The torch path is the group softmax (softmax, nan_to_num, mean over the group) and ``torch.topk``
(unsorted); the kernel computes the same mass and a radix select in one launch. Rows are (decode token,
KV head) pairs: 8 at batch 1, 64 at batch 8 of the Llama-3.1-8B attention shape (8 KV heads, G = 4);
units are Quest's 16-token pages of the context. ``split_units=0`` is one program per row; otherwise
each row is split over programs of that many units. Each timing is the median over repetitions after a GPU
sleep that keeps launch overhead off the clock. With ``--sweep`` a grid of ``TopConfig`` is timed and
the ten fastest printed per shape, with the ratio torch / kernel.

Usage: ``python bench/bench_unit_topk.py [--sweep] [--contexts 65536 131072] [--rows 8 64]``
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.kernels.unit_topk import DEFAULT_TOP, TopConfig, group_mass_ref, group_top_units  # noqa: E402

G, PAGE, BUDGET = 4, 16, 0.02


def timed(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of ``fn`` on the GPU."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        torch.cuda._sleep(1_000_000)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))[reps // 2]


def torch_path(logits: torch.Tensor, k: int) -> torch.Tensor:
    """What page selection ran before the kernel: the group softmax mass, then ``torch.topk``."""
    return torch.topk(group_mass_ref(logits), k, dim=-1, sorted=False).indices


def configs(sweep: bool) -> list[TopConfig]:
    if not sweep:
        return [DEFAULT_TOP]
    grid = itertools.product((0, 256, 512, 1024), (4, 8))
    return [TopConfig(split_units=s, num_warps=w) for s, w in grid]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for ctx, r in itertools.product(args.contexts, args.rows):
        u = ctx // PAGE
        k = int(BUDGET * ctx) // PAGE
        logits = 4 * torch.randn(r, G, u, device="cuda")
        t_torch = timed(functools.partial(torch_path, logits, k))
        want = set(map(tuple, torch_path(logits, k).sort(-1).values.tolist()))
        rows = []
        for cfg in configs(args.sweep):
            run = functools.partial(group_top_units, logits, k, config=cfg)
            same = set(map(tuple, run().tolist())) == want
            rows.append((timed(run), cfg, same))
        print(f"{u} pages, {r} rows, k {k}: torch {t_torch:.1f} us")
        for t, cfg, same in sorted(rows, key=lambda x: x[0])[:10]:
            print(f"  kernel {t:6.1f} us  torch/kernel {t_torch / t:5.2f}  same pages {same}  {cfg}")


if __name__ == "__main__":
    main()
