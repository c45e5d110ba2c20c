"""K-means seeding (Double-P's prefill clustering): k-means++ as it was, as it is, and in rounds, side by side.

Double-P's ``ClusterSummarizer`` seeds Lloyd k-means by k-means++ (``plus_plus_init``): one sequential step per
cluster (``C = n / 8``), each a pass over the row's keys (``[n, D] x [D, 1]``), a float64 cumulative sum over
``n`` and a ``searchsorted``. Rows per shape, timed interleaved (each rep runs every row once; medians):

- ``seeding, reference``: the step-per-op k-means++ of commit 545a8bb (``tests/test_kmeans_seeding.py``), 18 ops
  per step;
- ``seeding, plus_plus``: today's ``plus_plus_init`` (14 ops per step, the same ids bit for bit: checked here);
- ``seeding, plus_plus graphed`` (CUDA): the same steps replayed as one CUDA graph (``kmeans.SeedGraphs``, the same
  ids: checked here; its first call, which captures, is reported apart);
- ``seeding, plus_plus_batched``: ``plus_plus_batched_init`` (about ``SEED_ROUNDS + log2`` rounds of many draws
  instead of ``C`` steps; other ids, not the default);
- the whole ``kmeans`` call (10 iterations, early stop) with each seeding, and with ``init="random"``.

Shapes are the calls Double-P makes per layer: on the GPU Llama-3.1-8B's (8 KV heads, D = 128) at 128k, the 7 full
16k segments as rows of one call (``[56, 16384, 128]``, 2048 clusters) and the last segment (``[8, 16364, 128]``),
and 16k (one segment); on the CPU the shipped model's (2 KV heads, D = 64) at 4k and 16k and the 8B shape at 4k.
Ratios only (reference / this): no pass/fail.

    python3 bench/bench_kmeans_seeding.py              # GPU shapes (CUDA), or CPU shapes without a GPU
    python3 bench/bench_kmeans_seeding.py --device cpu --shapes tiny-4k tiny-16k
    python3 bench/bench_kmeans_seeding.py --quick      # smoke run (tiny shape, CPU)
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import describe_device, seconds  # noqa: E402
from workers.methods import kmeans as km  # noqa: E402

CLUSTER_SIZE, ITERS = 8, 10
"""Double-P's mean cluster size and Lloyd iterations (ClusterSummarizer)."""
SHAPES = {  # name: (rows, n, D); C = ceil(n / 8)
    "8b-128k-full": (56, 16384, 128),
    "8b-128k-last": (8, 16364, 128),
    "8b-16k": (8, 16364, 128),
    "8b-4k": (8, 4076, 128),
    "tiny-4k": (2, 4076, 64),
    "tiny-16k": (2, 16364, 64),
}
GPU_SHAPES = ["8b-16k", "8b-128k-last", "8b-128k-full"]
CPU_SHAPES = ["tiny-4k", "tiny-16k", "8b-4k"]
QUICK_SHAPE = (2, 300, 64)


def reference_seeding() -> Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]:
    """The pre-change k-means++ kept in the tests as the bit-for-bit reference (its source only: the test module
    needs pytest, which a GPU machine may lack)."""
    path = REPO / "tests" / "test_kmeans_seeding.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "plus_plus_init_reference")
    ns: dict[str, object] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns["plus_plus_init_reference"]  # type: ignore[return-value]


def bench_shape(name: str, shape: tuple[int, int, int], device: torch.device, reps: int, with_kmeans: bool) -> dict:
    h, n, d = shape
    c = math.ceil(n / CLUSTER_SIZE)
    x = torch.randn(h, n, d, generator=torch.Generator().manual_seed(0)).to(device).to(torch.bfloat16).float()
    ref = reference_seeding()

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(1)

    rows: dict[str, Callable[[], object]] = {
        "seeding, reference (545a8bb)": lambda: ref(x, c, gen()),
        "seeding, plus_plus": lambda: km.plus_plus_init(x, c, gen()),
        "seeding, plus_plus_batched": lambda: km.plus_plus_batched_init(x, c, gen()),
    }
    graphs = km.SeedGraphs() if device.type == "cuda" else None
    first_graphed = 0.0
    if graphs is not None:  # the steps as one CUDA graph (same ids): the first call captures, the rows replay
        first_graphed = seconds(lambda: km.plus_plus_init(x, c, gen(), graphs), device)
        rows["seeding, plus_plus graphed"] = lambda: km.plus_plus_init(x, c, gen(), graphs)
    if with_kmeans:
        def kmeans_ref() -> object:
            with mock.patch.object(km, "plus_plus_init", lambda x, c, g, graphs=None: ref(x, c, g)):
                return km.kmeans(x, c, iters=ITERS, seed=1, init="plus_plus")
        rows["kmeans, reference seeding"] = kmeans_ref
        for init in ("plus_plus", "plus_plus_batched", "random"):
            rows[f"kmeans, {init}"] = functools.partial(km.kmeans, x, c, iters=ITERS, seed=1, init=init)
        if graphs is not None:
            rows["kmeans, plus_plus graphed"] = functools.partial(km.kmeans, x, c, iters=ITERS, seed=1,
                                                                  init="plus_plus", graphs=graphs)
    same_ids = bool(torch.equal(ref(x, c, gen()), km.plus_plus_init(x, c, gen())))
    if graphs is not None:
        same_ids = same_ids and bool(torch.equal(ref(x, c, gen()), km.plus_plus_init(x, c, gen(), graphs)))
    for f in rows.values():  # warm-up
        f()
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(reps):  # interleaved: a load change hits every row alike
        for k, f in rows.items():
            times[k].append(seconds(f, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = []
    for k, t in med.items():
        base = med["seeding, reference (545a8bb)" if k.startswith("seeding") else "kmeans, reference seeding"]
        out.append({"name": k, "s": t, "ratio": base / t})
        print(f"  {name} {k}: {t:.4f} s", flush=True)
    if graphs is not None:
        print(f"  {name} seeding, plus_plus graphed, first call (capture + replay): {first_graphed:.4f} s", flush=True)
    return {"name": name, "H": h, "n": n, "C": c, "D": d, "first_graphed_s": first_graphed, "steps": {"plus_plus": c,
            "plus_plus_batched": 1 + len(km.batch_sizes(c))}, "same_ids": same_ids, "rows": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help=f"default: {' '.join(GPU_SHAPES)} on CUDA, {' '.join(CPU_SHAPES)} on the CPU")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-kmeans", action="store_true", help="seeding rows only")
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU, one rep")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        device, shapes, args.reps = torch.device("cpu"), {"quick": QUICK_SHAPE}, 1
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        names = args.shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
        shapes = {s: SHAPES[s] for s in names}
    results = [bench_shape(s, shape, device, args.reps, not args.no_kmeans) for s, shape in shapes.items()]
    print(f"\ndevice: {describe_device(device)}; {args.reps} interleaved reps, medians")
    for r in results:
        print(f"\n{r['name']}: rows={r['H']}, n={r['n']}, C={r['C']}, D={r['D']}; sequential steps: plus_plus "
              f"{r['steps']['plus_plus']}, plus_plus_batched {r['steps']['plus_plus_batched']}; plus_plus ids = "
              f"reference: {r['same_ids']}" + (f"; graphed, first call (capture + replay) {r['first_graphed_s']:.4f} s"
                                                if r["first_graphed_s"] else ""))
        print("| row | s per call | reference / this |")
        print("|---|---|---|")
        for row in r["rows"]:
            print(f"| {row['name']} | {row['s']:.4f} | {row['ratio']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": describe_device(device), "reps": args.reps, "shapes": results},
                                        indent=2))


if __name__ == "__main__":
    main()
