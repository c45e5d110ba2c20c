"""The training loop: curriculum batches, AdamW, bf16 autocast on GPU, checkpoints, time budget."""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from lab.train import checkpoint as ckpt
from lab.train.config import TrainConfig
from lab.train.data import batch_length, loader
from lab.train.objective import build_model, compute_loss, memory_floor_penalty
from workers.ratplus import memory_gates, set_memory_cap_scale
from workers.ratplus.modeling import MemoryGate

LOG_FILE = "log.jsonl"
RESTART_WARMUP = 50
"""Warm-up steps when resuming from exported weights without optimizer state."""


def lr_at(cfg: TrainConfig, step: int, restart: int | None = None) -> float:
    """Linear warm-up, cosine decay to `min_lr_ratio` over the stage; a fresh warm-up after a
    restart from exported weights in mid-stage (a fine-tune's own warm-up covers its start)."""
    warm = min(1.0, (step - cfg.start_step + 1) / cfg.warmup_steps)
    if restart is not None and restart > cfg.start_step:
        warm = min(warm, (step - restart + 1) / RESTART_WARMUP)
    progress = cfg.progress(step)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * warm * cosine


MEMORY_PARAMS = "memory_gate."
"""Name part of the RAT+ memory gates' parameters (trained at ``memory_lr_scale`` × the learning rate)."""


def make_optimizer(cfg: TrainConfig, model) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; the memory gates (RAT+) in groups of their own learning rate."""
    named = list(model.named_parameters())
    groups = []
    for memory in (False, True):
        mine = [p for n, p in named if (MEMORY_PARAMS in n) == memory]
        scale = cfg.memory_lr_scale if memory else 1.0
        groups += [{"params": [p for p in mine if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr_scale": scale,
                    "memory": memory},
                   {"params": [p for p in mine if p.ndim < 2], "weight_decay": 0.0, "lr_scale": scale,
                    "memory": memory}]
    groups = [g for g in groups if g["params"]]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


def restore(cfg: TrainConfig, out: Path, init: Path | None, tokenizer, device: str):
    """(model, optimizer, step, restart): from out/state.pt, else exported weights, else fresh."""
    state = ckpt.load_state(out)
    restart = None
    if state is not None:
        model = build_model(cfg.model, tokenizer, cfg.seed)
        model.load_state_dict(state["model"])
        step = state["step"]
    elif init is not None:
        model, step = ckpt.load_export(init, cfg.model)
        restart = step
    else:
        model, step = build_model(cfg.model, tokenizer, cfg.seed), 0
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to
    opt = make_optimizer(cfg, model)
    if state is not None:
        opt.load_state_dict(state["optim"])
    return model, opt, step, restart


def floor_record(gates: list[MemoryGate], penalty: torch.Tensor) -> dict[str, float]:
    """The log fields of the memory floor: its penalty and the layers' mean gate at the full cap."""
    means = [float(g.last_mean.detach()) for g in gates if g.last_mean is not None]
    return {"memory_floor_penalty": round(float(penalty.detach()), 6),
            "mean_gate": round(sum(means) / max(1, len(means)), 4)}


def train(
    cfg: TrainConfig,
    out: Path,
    tokenizer,
    *,
    init: Path | None = None,
    time_budget: float = math.inf,
    export_to: Path | None = None,
    device: str | None = None,
    stop_at: int | None = None,
) -> list[dict]:
    """Train from where `out` left off until `cfg.steps` (or `stop_at`, keeping `cfg`'s schedule) or
    `time_budget` seconds; returns the log."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    model, opt, step, restart = restore(cfg, out, init, tokenizer, device)
    model.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()
    t0, last_t, last_step, records = time.time(), time.time(), step, []
    out.mkdir(parents=True, exist_ok=True)
    floored = memory_gates(model, record_mean=True) if cfg.memory_gate_floor > 0 else []
    for batch in loader(cfg, tokenizer, step, pin=device == "cuda"):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        held = step - cfg.start_step < cfg.memory_hold_steps
        cap_scale = cfg.memory_cap_scale(step)
        set_memory_cap_scale(model, cap_scale)
        for group in opt.param_groups:
            frozen = held and group.get("memory", False)
            group["lr"] = 0.0 if frozen else lr_at(cfg, step, restart) * group.get("lr_scale", 1.0)
        with autocast:
            parts = compute_loss(model, batch, cfg.lm_weight, cfg.agg_weight)
        penalty = memory_floor_penalty(floored, cfg.memory_gate_floor) if floored else None
        (parts.loss if penalty is None else parts.loss + cfg.memory_floor_weight * penalty).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.time()
            rec = {
                "step": step,
                "len": batch_length(cfg, step - 1),
                "loss": round(float(parts.loss.detach()), 4),
                "ans_loss": round(float(parts.answer_loss), 4),
                "ans_acc": round(float(parts.answer_acc), 4),
                "lm_loss": round(float(parts.lm_loss), 4),
                "agg_loss": round(float(parts.agg_loss), 4),
                "agg_acc": round(float(parts.agg_acc), 4),
                "gnorm": round(float(gnorm), 3),
                "lr": lr_at(cfg, step - 1, restart),
                **({"memory_cap_scale": round(cap_scale, 4)} if cfg.memory_ramp_steps else {}),
                **(floor_record(floored, penalty) if penalty is not None else {}),
                "s_per_step": round((now - last_t) / (step - last_step), 4),
                "elapsed": round(now - t0, 1),
            }
            last_t, last_step = now, step
            records.append(rec)
            print(json.dumps(rec), flush=True)
            with open(out / LOG_FILE, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if step % cfg.checkpoint_every == 0:
            ckpt.save_state(out, model, opt, step, cfg.to_dict())
        if time.time() - t0 > time_budget or (stop_at is not None and step >= stop_at):
            break
    set_memory_cap_scale(model, 1.0)  # the ramp is training-only state: the model leaves with its full cap
    memory_gates(model, record_mean=False)  # nor do the gates keep recording
    ckpt.save_state(out, model, opt, step, cfg.to_dict())
    if export_to is not None:
        ckpt.export(model, export_to, step, cfg.to_dict(), ckpt.stage_history(init))
    return records
