"""Top-K's page mass on the CPU, one layer: the fused kernel on the codes against the torch paths it replaces.

``kernel`` is ``workers/kernels/index_page_mass`` (what ``topk`` runs on the CPU when the kernel builds);
``decoded`` the torch path before it (float32 keys decoded once, channel-major: ``decoded_logits``, then
``page_mass_ref``); ``codes`` the torch path past the decoded-keys cap (``index_logits`` on the codes, then
``page_mass_ref``). Each is timed hot (repeated back to back) and cold (a 64 MiB write between calls evicts
the caches, as a decode step's other work does). One query token, 16-token pages, a random 4-bit index of
quantized Gaussian keys.

    OMP_NUM_THREADS=1 python3 bench/bench_index_page_mass.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.kernels.index_page_mass import CodeTiles, cpu_kernel_available, index_page_mass, page_mass_ref  # noqa: E402
from workers.methods.key_index import DecodedIndex, decoded_logits, index_logits, quantize_keys  # noqa: E402

SHAPES = {"tiny": (2, 4, 64), "llama8b": (8, 4, 128)}
"""KV heads, query heads per KV head, head dim: the shipped model's and Llama-3.1-8B's attention."""
PAGE = 16


def _median_ms(fn: Callable[[], object], reps: int, evict: torch.Tensor | None) -> float:
    fn()
    times = []
    for _ in range(reps):
        if evict is not None:
            evict.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(shape: str, n: int, reps: int) -> dict[str, float]:
    """Median ms per call of each path, hot and cold, at ``n`` prefix tokens (mid: all but 4 + 64)."""
    hkv, g, d = SHAPES[shape]
    k = torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(0))
    art = quantize_keys(k)
    q = torch.randn(1, hkv, g, d, generator=torch.Generator().manual_seed(1))
    lo, hi, scale = 4, n - 64, d ** -0.5
    keys = DecodedIndex().get(0, art["codes"], art["lo"], art["step"], 4, 64)
    assert keys is not None
    tiles = CodeTiles.from_index(art["codes"], art["lo"], art["step"], 4, 64)
    paths: dict[str, Callable[[], object]] = {
        "decoded": lambda: page_mass_ref(decoded_logits(q, keys, lo, hi).mul_(scale), lo, hi, PAGE),
        "codes": lambda: page_mass_ref(index_logits(q, art["codes"], art["lo"], art["step"], 4, 64, lo, hi)
                                       .mul_(scale), lo, hi, PAGE),
        "kernel": lambda: index_page_mass(q, tiles, scale, lo, hi, PAGE),
    }
    evict = torch.zeros(16 << 20)
    out = {}
    for name, fn in paths.items():
        out[f"{name}_hot"] = _median_ms(fn, reps, None)
        out[f"{name}_cold"] = _median_ms(fn, reps, evict)
    return out


def main() -> None:
    """Print one row per (shape, length)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["tiny:4096", "tiny:16384", "llama8b:32768"],
                    help="shape:tokens (shapes: " + ", ".join(SHAPES) + ")")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not cpu_kernel_available():
        raise SystemExit("the CPU kernel did not build (see the log)")
    print(f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}, page {PAGE}, int4 index, block 64")
    print("| shape | tokens | decoded hot / cold (ms) | codes hot / cold (ms) | kernel hot / cold (ms) | "
          "kernel vs decoded, cold |")
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        shape, n = case.split(":")
        r = run(shape, int(n), args.reps)
        print(f"| {shape} | {int(n)} | {r['decoded_hot']:.3f} / {r['decoded_cold']:.3f} | {r['codes_hot']:.3f} / "
              f"{r['codes_cold']:.3f} | {r['kernel_hot']:.3f} / {r['kernel_cold']:.3f} | "
              f"{r['decoded_cold'] / r['kernel_cold']:.2f}x |")


if __name__ == "__main__":
    main()
