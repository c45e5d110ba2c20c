"""A decode step's token choice for B sampled generations: one batch per row (as before) vs one per setting.

Logits ``[B, --vocab]`` (Llama-3's 128,256 by default) in bf16 on CUDA, float32 on the CPU; every row sampled at
temperature 0.8, top-p 0.95, its own seeded generator. Rows: *per row* = ``Sampler.pick`` on each row in turn (a
softmax, a sort of the vocabulary, a scan and about ten more launches per row: what the engine ran per sampled
generation before); *batched* = ``sampling.pick_rows`` (the rows of one setting sampled in one softmax / sort /
scan). Printed per batch size: median ms of each, their ratio, and whether both give the same tokens.

    python3 bench/bench_sampling.py --batch 1 8 32 --json out.json
    python3 bench/bench_sampling.py --quick          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import describe_device, timed  # noqa: E402
from workers.requests import SamplingParams  # noqa: E402
from workers.sampling import Sampler, pick_rows  # noqa: E402

PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


def samplers(n: int, device: torch.device) -> list[Sampler]:
    """``n`` samplers of ``PARAMS``, seeded 0..n-1."""
    return [Sampler(SamplingParams(temperature=PARAMS.temperature, top_p=PARAMS.top_p, seed=i), device)
            for i in range(n)]


def per_row(ss: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Each row by its own sampler's ``pick``, in turn."""
    return torch.stack([s.pick(row) for s, row in zip(ss, logits, strict=True)])


def measure(b: int, vocab: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """Both ways at batch ``b``: median ms, ratio, same tokens (fresh generators with the same seeds for each)."""
    logits = (torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 3).to(device, dtype)
    same = bool(torch.equal(per_row(samplers(b, device), logits), pick_rows(samplers(b, device), logits)))
    a, c = samplers(b, device), samplers(b, device)
    t_row = timed(lambda: per_row(a, logits), reps, device)
    t_batch = timed(lambda: pick_rows(c, logits), reps, device)
    return {"batch": b, "per_row_ms": 1e3 * t_row, "batched_ms": 1e3 * t_batch, "ratio": t_batch / t_row,
            "same_tokens": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="small CPU run")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.batch, args.vocab, args.reps = [1, 4], 4096, 5
    rows = [measure(b, args.vocab, device, dtype, args.reps) for b in args.batch]
    print(f"device: {describe_device(device)}; vocab {args.vocab}; T {PARAMS.temperature}, top-p {PARAMS.top_p}\n")
    print("| batch | per row ms | batched ms | batched / per row | same tokens |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['per_row_ms']:.3f} | {r['batched_ms']:.3f} | {r['ratio']:.2f} "
              f"| {r['same_tokens']} |")
    if args.json:
        args.json.write_text(json.dumps({"vocab": args.vocab, "rows": rows}, indent=2))
    if not all(r["same_tokens"] for r in rows):
        sys.exit("batched sampling gave other tokens than sampling each row alone")


if __name__ == "__main__":
    main()
