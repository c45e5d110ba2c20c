"""Prefill-time summaries, one layer at a time: how long each summarizer takes per layer, and how much of that the
device is busy (``--profile``: the top kernels of each, from torch's profiler).

    python3 bench/bench_summaries.py --ctx 131072 --layers 4 --device cuda --profile --json out.json
    python3 bench/bench_summaries.py --quick      # CPU smoke (a test runs it)

Every row is one summarizer of ``workers.methods.registry.prefill_summarizers`` (the default feature map for φ,
FAVOR+, as the random-weight benches use) over random bf16 K/V of Llama-3.1-8B's KV shape (8 KV heads, D=128);
the table gives each one's median time per layer and its share of all of them, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from workers.methods.registry import build_summarizers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv(ctx: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype, seed: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(heads, ctx, dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(heads, ctx, dim, generator=g).to(device=device, dtype=dtype)
    return k, v


def _profile(fn: Any, device: torch.device, top: int) -> tuple[float, list[tuple[str, float, int]]]:
    """Device-busy ms of one call and its ``top`` kernels (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    rows = []
    busy = 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if dev_us > 0:
            rows.append((e.key[:90], dev_us / 1e3, e.count))
            busy += dev_us / 1e3
    rows.sort(key=lambda r: -r[1])
    return busy, rows[:top]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every summarizer over ``args.layers`` layers; returns the rows."""
    device = torch.device(args.device)
    dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[args.dtype])
    summarizers = build_summarizers()
    layers = [_kv(args.ctx, args.heads, args.dim, device, dtype, seed=i) for i in range(args.layers)]
    for s in summarizers:  # warm-up: kernel builds, autotune, allocator
        s.summarize(0, *layers[0])
    _sync(device)
    rows: list[dict[str, Any]] = []
    for s in summarizers:
        times = []
        for layer, (k, v) in enumerate(layers):
            _sync(device)
            t0 = time.perf_counter()
            s.summarize(layer, k, v)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        row: dict[str, Any] = {"summarizer": s.name, "ms_per_layer": statistics.median(times), "times_ms": times}
        if args.profile:
            busy, top = _profile(lambda s=s: s.summarize(0, *layers[0]), device, args.top)
            row["device_busy_ms"], row["top_kernels"] = busy, top
        rows.append(row)
    total = sum(r["ms_per_layer"] for r in rows)
    print(f"\nsummaries per layer: ctx {args.ctx}, {args.heads} KV heads, D={args.dim}, {args.dtype}, "
          f"{device.type}, {args.layers} layers")
    head = "| summarizer | ms per layer | share |" + (" device busy ms | busy / wall |" if args.profile else "")
    print(head)
    print("|---|---|---|" + ("---|---|" if args.profile else ""))
    for r in rows:
        line = f"| {r['summarizer']} | {r['ms_per_layer']:.2f} | {r['ms_per_layer'] / total:.2f} |"
        if args.profile:
            line += f" {r['device_busy_ms']:.2f} | {r['device_busy_ms'] / r['ms_per_layer']:.2f} |"
        print(line)
    print(f"| all | {total:.2f} | 1.00 |")
    if args.profile:
        for r in rows:
            print(f"\n{r['summarizer']}: top kernels (ms, calls)")
            for name, ms, calls in r["top_kernels"]:
                print(f"  {ms:8.3f} {calls:6d}  {name}")
    return {"ctx": args.ctx, "heads": args.heads, "dim": args.dim, "dtype": args.dtype, "device": device.type,
            "layers": args.layers, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="layers timed (each its own random K/V)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--profile", action="store_true", help="also the device-busy time and top kernels")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="a small CPU shape (smoke)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.ctx, args.heads, args.dim, args.layers, args.device, args.dtype = 2048, 2, 32, 2, "cpu", "fp32"
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
