"""CLI: continued training of the shipped model as RAT+ and as the plain baseline, equally long (issue 17).

python -m lab.train.continued --out runs/cont --max-minutes 9 --workers 14            # first command
python -m lab.train.continued --out runs/cont --max-minutes 9 --workers 14 --resume   # until both are done

Both variants start from ``--init`` (default the shipped ``models/kvstash-tiny``) and train on the same
batches (batch ``s`` depends only on the config and ``s``) with the same schedule; RAT+ gets the memory
module in every layer, its gates at ``memory_lr_scale`` × the learning rate. RAT+ trains first, within
its share of the wall-clock limit; the plain model then trains up to exactly RAT+'s step, so the two
always ship at the same step. Both save their state (``OUT/<variant>/state.pt``) at every checkpoint
and when time runs out, and are exported after every command, so a timeout keeps what was trained;
``--resume`` continues both. Exports: ``models/kvstash-tiny-rat`` and ``models/kvstash-tiny-cont``, each
with a card (``README.md``: command, steps, log).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from lab.train import checkpoint as ckpt
from lab.train.config import PRESETS, TINY_MODEL, TrainConfig
from lab.train.loop import LOG_FILE, train
from lab.train.run import ship

MODELS = Path(__file__).resolve().parents[2] / "models"
SHIPPED = MODELS / "kvstash-tiny"
VARIANTS = {"rat": "kvstash-tiny-rat", "plain": "kvstash-tiny-cont"}
"""Run sub-folder -> exported model name."""
RAT_SHARE = 0.6
"""Share of the wall-clock limit RAT+ may use (it is the slower one; plain then catches up to its step)."""
EXPORT_RESERVE_S = 30.0
"""Seconds of the limit kept for exporting both variants and writing their cards."""
MEMORY_LENGTH = 64.0
"""RAT+'s longest effective memory length (the paper's)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description="Continued training: RAT+ and the plain baseline, equally long.")
    p.add_argument("--out", type=Path, required=True, help="run folder (OUT/rat, OUT/plain)")
    p.add_argument("--max-minutes", type=float, required=True, help="wall-clock limit of this command")
    p.add_argument("--steps", type=int, help="steps of the stage (default: the `continued` preset's)")
    p.add_argument("--init", type=Path, default=SHIPPED, help="plain weights to start from")
    p.add_argument("--models", type=Path, default=MODELS, help="where the two exports go")
    p.add_argument("--workers", type=int, help="batch-generating processes")
    p.add_argument("--resume", action="store_true", help="continue the runs in OUT")
    p.add_argument("--tiny", action="store_true", help="the CPU-test model shape and batches (smoke tests)")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS),
                   help="which to train (rat alone: the plain baseline is already exported at the same steps)")
    p.add_argument("--memory-gate-bias", type=float, help="RAT+ gates' initial logit (default: the config's)")
    p.add_argument("--memory-lr-scale", type=float, help="RAT+ gates' learning-rate multiplier")
    p.add_argument("--memory-hold-steps", type=int, help="first steps with the RAT+ gates held at their init")
    p.add_argument("--memory-gate-floor", type=float,
                   help="RAT+: a floor on each layer's mean gate, kept by a loss penalty (ours; 0: off)")
    p.add_argument("--memory-floor-weight", type=float, help="weight of the --memory-gate-floor penalty")
    p.add_argument("--memory-ramp-steps", type=int,
                   help="first steps over which the RAT+ gates' cap grows linearly from 0 (plain) to full")
    return p.parse_args(argv)


def variant_config(base: TrainConfig, variant: str) -> TrainConfig:
    """The run config of ``variant``: identical for both but for the memory module."""
    if variant == "plain":
        return replace(base, memory_hold_steps=0, memory_ramp_steps=0, memory_gate_floor=0.0)
    return replace(base, model=replace(base.model, memory_max_length=MEMORY_LENGTH))


def base_config(args: argparse.Namespace) -> TrainConfig:
    """The shared config: the `continued` preset (or the tiny smoke shape), starting at the init's step."""
    cfg = PRESETS["continued"]
    if args.tiny:
        cfg = replace(cfg, model=TINY_MODEL, tokens_per_batch=768, workers=0, log_every=1, checkpoint_every=2,
                      curriculum=(replace(cfg.curriculum[-1], lengths=(128,)),))
    overrides = {"steps": args.steps, "workers": args.workers, "memory_lr_scale": args.memory_lr_scale,
                 "memory_hold_steps": args.memory_hold_steps, "memory_ramp_steps": args.memory_ramp_steps,
                 "memory_gate_floor": args.memory_gate_floor, "memory_floor_weight": args.memory_floor_weight}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.memory_gate_bias is not None:
        cfg = replace(cfg, model=replace(cfg.model, memory_gate_bias=args.memory_gate_bias))
    start = ckpt.export_step(args.init)
    return replace(cfg, start_step=start, steps=start + cfg.steps)


def saved_step(run: Path) -> int | None:
    """The step a run folder's state is at (None: not started)."""
    state = ckpt.load_state(run)
    return None if state is None else int(state["step"])


def run_variant(cfg: TrainConfig, run: Path, args: argparse.Namespace, tok, *, until: int, seconds: float) -> int:
    """Train ``run`` up to step ``until`` within ``seconds``; export it; the step it reached."""
    at = saved_step(run)
    if at is None or at < until:  # the schedule spans the whole stage even when stopping early
        train(cfg, run, tok, init=args.init, time_budget=max(0.0, seconds), stop_at=until)
    return saved_step(run) or cfg.start_step


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if any((args.out / v).exists() and any((args.out / v).iterdir()) for v in args.variants) and not args.resume:
        raise SystemExit(f"{args.out} already holds runs; pass --resume or another --out")
    t0 = time.time()
    limit = 60.0 * args.max_minutes
    tok = AutoTokenizer.from_pretrained(args.init)
    base = base_config(args)
    rat_cfg, plain_cfg = variant_config(base, "rat"), variant_config(base, "plain")
    steps: dict[str, int] = {}
    if "rat" in args.variants:  # alone, it has the whole limit but the export's reserve
        seconds = RAT_SHARE * limit if "plain" in args.variants else limit - EXPORT_RESERVE_S
        steps["rat"] = run_variant(rat_cfg, args.out / "rat", args, tok, until=base.steps, seconds=seconds)
    if "plain" in args.variants:  # up to RAT+'s step, so the two ship equally long
        steps["plain"] = run_variant(plain_cfg, args.out / "plain", args, tok, until=steps.get("rat", base.steps),
                                     seconds=limit - (time.time() - t0) - EXPORT_RESERVE_S)
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "lab.train.continued", *sys.argv[1:]]) \
        if argv is None else " ".join(["python -m lab.train.continued", *map(shlex.quote, argv)])
    for variant, cfg in (("rat", rat_cfg), ("plain", plain_cfg)):
        if variant in steps:
            export_variant(args, cfg, variant, steps[variant], command, tok)
    print(json.dumps({"rat_step": steps.get("rat"), "plain_step": steps.get("plain"), "target": base.steps,
                      "equal": len(set(steps.values())) == 1, "seconds": round(time.time() - t0, 1)}), flush=True)


def export_variant(args: argparse.Namespace, cfg: TrainConfig, variant: str, step: int, command: str, tok) -> None:
    """Write ``models/<name>``: weights at ``step`` (from the run's state), tokenizer, runtime file, card."""
    from lab.train.objective import build_model

    run, dest = args.out / variant, args.models / VARIANTS[variant]
    state = ckpt.load_state(run)
    if state is None:
        return
    model = build_model(cfg.model, tok, cfg.seed)
    model.load_state_dict(state["model"])
    ckpt.export(model, dest, step, cfg.to_dict(), ckpt.stage_history(args.init))
    ship(dest, args.init, tok.eos_token, max(n for st in cfg.curriculum for n in st.lengths))
    log = (run / LOG_FILE).read_text() if (run / LOG_FILE).exists() else ""
    (dest / "logs").mkdir(exist_ok=True)
    (dest / "logs" / "continued.jsonl").write_text(log)
    (dest / "README.md").write_text(card(variant, cfg, step, command, log))


def card(variant: str, cfg: TrainConfig, step: int, command: str, log: str) -> str:
    """The model card of one variant."""
    rows = [json.loads(line) for line in log.splitlines() if line.strip()]
    done = step - cfg.start_step
    what = ("RAT+: every layer's keys and values pass through a gated decaying memory "
            f"(k̃_t = g_t ⊙ k̃_(t−1) + (1 − g_t) ⊙ k_t, same for v, before RoPE; g = (1 − 1/{MEMORY_LENGTH:g}) · "
            f"σ(W x + b) per KV channel, W = 0 and b = {cfg.model.memory_gate_bias:g} at the start; "
            f"`workers/ratplus`). Load it after `import workers.ratplus` (the product's loader does this)."
            if variant == "rat" else
            "The plain model (transformers Llama), continued on the same batches with the same schedule: the "
            "fair baseline of `kvstash-tiny-rat`.")
    last = rows[-1] if rows else {}
    return "\n".join([
        f"# {VARIANTS[variant]}: kvstash-tiny continued for {done} steps ({'RAT+' if variant == 'rat' else 'plain'})",
        "",
        what,
        "",
        "## Training",
        "",
        f"From `kvstash-tiny` (step {cfg.start_step}), steps {cfg.start_step}-{step} of a {cfg.steps - cfg.start_step}"
        f"-step stage (`PRESETS['continued']` in `lab/train/config.py`: stage 3's data mix and curriculum, lr "
        f"{cfg.lr:g} with {cfg.warmup_steps} warm-up steps and cosine decay, "
        + (f"memory gates at {cfg.memory_lr_scale:g}× the lr"
           + (f", held at their init for the first {cfg.memory_hold_steps} steps" if cfg.memory_hold_steps else "")
           + (f", their cap ramped linearly from 0 (the plain model) to 1 − 1/{MEMORY_LENGTH:g} over the first "
              f"{cfg.memory_ramp_steps} steps" if cfg.memory_ramp_steps else "")
           + (f", each layer's mean gate held above {cfg.memory_gate_floor:g} by a penalty of weight "
              f"{cfg.memory_floor_weight:g} (ours, not the paper's)" if cfg.memory_gate_floor else "")
           + ", " if variant == "rat" else "")
        + f"{cfg.tokens_per_batch} tokens per batch, seed {cfg.seed}).",
        "",
        "```",
        command,
        "```",
        "",
        f"Last logged step: {json.dumps(last)}" if last else "No step logged.",
        "",
        "Log: `logs/continued.jsonl` (one line per logged step); config: `trainer_state.json`.",
        "",
    ])


if __name__ == "__main__":
    main()
