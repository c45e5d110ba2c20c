"""CLI: train (or resume) the kvstash tiny model.

python -m lab.train.run --out runs/tiny --steps 4000 --export models/kvstash-tiny --ship
python -m lab.train.run --out runs/tiny --resume --time-budget 500 --export /tmp/export
python -m lab.train.run --out runs/ft --preset aggregation --init models/kvstash-tiny --export /tmp/ft

With --init, the run is a new stage starting at the exported weights' step: --steps more steps
with their own warm-up, LR decay and length curriculum (resume such a run with the same --init).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from lab.synth import PROMPT
from lab.train import checkpoint as ckpt
from lab.train.config import PRESETS, TINY_MODEL, TrainConfig
from lab.train.loop import train

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "kvstash-tiny"
RUNTIME_FILE = "kvstash.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description="Train the kvstash tiny long-context model.")
    p.add_argument("--out", type=Path, required=True, help="run folder: state.pt (resume) and log.jsonl")
    p.add_argument("--steps", type=int, help="optimizer steps of this stage (sets the LR schedule and curriculum)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="base", help="named recipe (config.PRESETS)")
    p.add_argument("--tiny", action="store_true", help="the CPU-test model shape")
    p.add_argument("--config", type=Path, help="a TrainConfig JSON (as written in trainer_state.json)")
    p.add_argument("--tokens-per-batch", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--resume", action="store_true", help="continue from OUT/state.pt when it exists")
    p.add_argument("--init", type=Path, help="start from exported weights (no optimizer state)")
    p.add_argument("--time-budget", type=float, default=math.inf, help="seconds; then save and stop")
    p.add_argument("--export", type=Path, help="write bf16 safetensors shards and config here at the end")
    p.add_argument("--ship", action="store_true", help="also write tokenizer files and kvstash.json to --export")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config: file or preset, then command-line overrides; an --init stage starts at
    the exported weights' step and runs `steps` steps past it."""
    cfg = TrainConfig.from_dict(json.loads(args.config.read_text())) if args.config else PRESETS[args.preset]
    if args.tiny:
        cfg = replace(cfg, model=TINY_MODEL)
    overrides = {"steps": args.steps, "tokens_per_batch": args.tokens_per_batch, "workers": args.workers, "lr": args.lr}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.init is not None and not args.config:
        start = ckpt.export_step(args.init)
        cfg = replace(cfg, start_step=start, steps=start + cfg.steps)
    return cfg


def ship(dest: Path, tokenizer_dir: Path, eos_token: str, trained_context: int) -> None:
    """Copy the tokenizer next to exported weights and write the runtime's prompt format and trained length."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).resolve() != (dest / name).resolve():
            shutil.copy(tokenizer_dir / name, dest / name)
    runtime = {**PROMPT.runtime_config(eos_token), "trained_context": trained_context}  # the CLI warns beyond it
    (dest / RUNTIME_FILE).write_text(json.dumps(runtime, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    cfg = build_config(args)
    if (args.out / ckpt.STATE_FILE).exists() and not args.resume:
        raise SystemExit(f"{args.out} already holds a run; pass --resume or another --out")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train(cfg, args.out, tok, init=args.init, time_budget=args.time_budget, export_to=args.export)
    if args.export and args.ship:
        ship(args.export, args.tokenizer, tok.eos_token, max(n for st in cfg.curriculum for n in st.lengths))


if __name__ == "__main__":
    main()
