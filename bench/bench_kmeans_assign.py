"""K-means assignment (Double-P's prefill clustering): the fused Triton kernel against the torch reference.

Double-P's ``ClusterSummarizer`` runs Lloyd k-means per layer over the mid keys (8 KV heads, D = 128,
``C = n / 8`` clusters, up to 11 assignments) within segments of ``segment_tokens`` = 16k tokens: at 128k
one call on ``[8 * 7, 16k, 128]`` and one on the shorter last segment ``[8, < 16k, 128]``, 2k clusters per
row. The shapes here are one segment spanning the whole 32k or 128k (the problem before segments, 2-8x the
distances of a layer now): a stress test of the kernel. The torch reference materialises ``[H, 8192, C]``
float32 distance blocks and takes their argmin; the kernel keeps a running minimum per point over centroid
blocks.
For each shape it times one assignment by the reference (float32) and by the kernel with float32 points
(tf32 and ieee products) and with bf16 points (the keys' own dtype), and reports, for a sample of
points, how often the kernel's label equals the reference's and the largest float64 excess distance of
its choice over the nearest centroid (near-ties may flip). Then one whole ``kmeans`` call (10 iterations,
early stop) with either assignment. Ratios only: no pass/fail.

    python3 bench/bench_kmeans_assign.py                   # 32k and 128k shapes on the GPU
    python3 bench/bench_kmeans_assign.py --sweep           # also a grid of kernel configs per shape
    python3 bench/bench_kmeans_assign.py --quick           # smoke run (tiny shape, CPU, Triton interpreter)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if "--quick" in sys.argv:  # before anything imports triton: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import describe_device, timed  # noqa: E402
from workers.kernels.kmeans_assign import KmeansAssignConfig, kmeans_assign  # noqa: E402
from workers.methods import kmeans as km  # noqa: E402

HEADS, DIM, CLUSTER_SIZE, ITERS = 8, 128, 8, 10
"""Llama-3.1-8B's KV heads and head dim; Double-P's mean cluster size and iterations (ClusterSummarizer)."""
SHAPES = {"32k": 32768, "128k": 131072}
QUICK_SHAPE = (2, 300, 40, 64)
"""``--quick``: H, n, C, D."""
SAMPLE = 2048
"""Points whose labels are checked against the reference (float64 distances to every centroid)."""


def variants(sweep: bool) -> list[tuple[str, torch.dtype, KmeansAssignConfig]]:
    """(name, dtype of the points, config) of the kernel rows."""
    rows = [("kernel fp32 x, tf32", torch.float32, KmeansAssignConfig()),
            ("kernel fp32 x, ieee", torch.float32, KmeansAssignConfig(fp32_precision="ieee")),
            ("kernel bf16 x", torch.bfloat16, KmeansAssignConfig())]
    if sweep:
        for dtype, (bn, bc, w, s) in itertools.product((torch.bfloat16, torch.float32),
                                                      itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))):
            cfg = KmeansAssignConfig(block_n=bn, block_c=bc, num_warps=w, num_stages=s)
            rows.append((f"sweep {str(dtype)[6:]} n{bn} c{bc} w{w} s{s}", dtype, cfg))
    return rows


def check(labels: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, c: torch.Tensor) -> tuple[float, float]:
    """(share of sampled labels equal to the reference's, largest float64 excess distance of the chosen centroid)."""
    idx = torch.linspace(0, x.shape[1] - 1, min(SAMPLE, x.shape[1]), device=x.device).long()
    dist = torch.cdist(x[:, idx].double(), c.double()).square()
    got = labels[:, idx]
    excess = dist.gather(2, got[..., None])[..., 0] - dist.min(-1).values
    return (got == ref[:, idx]).float().mean().item(), excess.max().item()


def bench_shape(name: str, shape: tuple[int, int, int, int], device: torch.device, reps: int, sweep: bool,
                use_kmeans: bool) -> dict:
    """Every row at one shape: the reference and kernel variants (one assignment), then whole kmeans calls."""
    h, n, c, d = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(h, n, d, generator=gen).to(device).to(torch.bfloat16).float()  # keys are bf16 values
    cent = x[:, torch.randperm(n, generator=gen)[:c].to(device)] + 0.01 * torch.randn(h, c, d, generator=gen).to(device)
    time_of: Callable[[Callable[[], object]], float] = functools.partial(timed, reps=reps, device=device, warmup=1)
    ref = kmeans_assign(x, cent, use_triton=False)
    t_ref = time_of(lambda: kmeans_assign(x, cent, use_triton=False))
    rows = [{"name": "reference fp32 (einsum + argmin)", "ms": t_ref * 1e3, "speedup": 1.0, "agree": 1.0,
             "max_excess": check(ref, ref, x, cent)[1]}]
    for label, dtype, cfg in variants(sweep):
        xs = x.to(dtype)
        run = functools.partial(kmeans_assign, xs, cent, use_triton=True, config=cfg)
        try:
            labels = run()
        except Exception as e:  # a swept config past the GPU's registers or shared memory: skip it
            if not label.startswith("sweep"):
                raise
            print(f"  {name} {label}: failed ({type(e).__name__})", flush=True)
            continue
        agree, excess = check(labels, ref, x, cent)
        t = time_of(run)
        rows.append({"name": label, "ms": t * 1e3, "speedup": t_ref / t, "agree": agree, "max_excess": excess})
        print(f"  {name} {label}: {t * 1e3:.2f} ms", flush=True)
    kmeans_rows = []
    if use_kmeans:
        t_km_ref = 0.0
        for label, assign in (("kmeans, reference assign", functools.partial(kmeans_assign, use_triton=False)),
                              ("kmeans, kernel assign (fp32 x, tf32)",
                               functools.partial(kmeans_assign, use_triton=True))):
            with mock.patch.object(km, "kmeans_assign", assign):
                t = time_of(lambda: km.kmeans(x, c, iters=ITERS, seed=0))
            t_km_ref = t_km_ref or t
            kmeans_rows.append({"name": label, "s": t, "speedup": t_km_ref / t})
            print(f"  {name} {label}: {t:.3f} s", flush=True)
    return {"name": name, "H": h, "n": n, "C": c, "D": d, "rows": rows, "kmeans": kmeans_rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel configs")
    p.add_argument("--no-kmeans", action="store_true", help="skip the whole-kmeans rows")
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU through the Triton interpreter")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        device = torch.device("cpu")
        shapes = {"quick": QUICK_SHAPE}
        args.reps = 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --quick)")
        device = torch.device("cuda")
        shapes = {s: (HEADS, SHAPES[s], SHAPES[s] // CLUSTER_SIZE, DIM) for s in args.shapes}
    results = [bench_shape(s, shape, device, args.reps, args.sweep, not args.no_kmeans) for s, shape in shapes.items()]
    print(f"\ndevice: {describe_device(device)}")
    for r in results:
        print(f"\n{r['name']}: H={r['H']}, n={r['n']}, C={r['C']}, D={r['D']} (one assignment; labels on "
              f"{min(SAMPLE, r['n'])} sampled points per head)")
        print("| variant | ms | reference / this | labels = reference | max excess distance |")
        print("|---|---|---|---|---|")
        for row in r["rows"]:
            print(f"| {row['name']} | {row['ms']:.2f} | {row['speedup']:.2f} | {row['agree']:.4f} | "
                  f"{row['max_excess']:.3g} |")
        if r["kmeans"]:
            print(f"\n| kmeans ({ITERS} iterations, early stop) | s per layer | reference / this |")
            print("|---|---|---|")
            for row in r["kmeans"]:
                print(f"| {row['name']} | {row['s']:.3f} | {row['speedup']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": describe_device(device), "shapes": results}, indent=2))


if __name__ == "__main__":
    main()
