"""Throughput probe: seconds per optimizer step and peak memory at each batch length.

python -m lab.train.probe --lengths 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch
from transformers import AutoTokenizer

from lab.synth import SynthContext
from lab.train.config import TrainConfig
from lab.train.data import make_batch
from lab.train.loop import make_optimizer
from lab.train.objective import build_model, compute_loss
from lab.train.run import DEFAULT_TOKENIZER


def probe(cfg: TrainConfig, tok, lengths: list[int], repeats: int, device: str) -> list[dict]:
    """Time batch generation (one CPU process) and training steps at each length."""
    model = build_model(cfg.model, tok, cfg.seed).to(device)  # type: ignore[arg-type]
    opt = make_optimizer(cfg, model)
    ctx = SynthContext(tok, "train")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for length in lengths:
        t0 = time.time()
        batch = {k: v.to(device) for k, v in make_batch(cfg, tok, ctx, 0, length).items()}
        gen_s = time.time() - t0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sync()
            t0 = time.time()
            with autocast:
                loss = compute_loss(model, batch, cfg.lm_weight, cfg.agg_weight).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.time() - t0)
        step_s = sum(times[1:]) / repeats
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        tokens = batch["input_ids"].numel()
        rows.append(
            {
                "length": length,
                "tokens": tokens,
                "step_s": round(step_s, 4),
                "gen_s_one_proc": round(gen_s, 3),
                "tok_per_s": round(tokens / step_s),
                "peak_gib": round(peak, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="*", type=int, default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probe(TrainConfig(), AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER), args.lengths, args.repeats, device)


if __name__ == "__main__":
    main()
