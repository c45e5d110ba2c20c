"""Training state on disk (resume) and bf16 safetensors exports (ship / bring back)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from lab.train.config import ModelConfig

STATE_FILE = "state.pt"
TRAINER_STATE = "trainer_state.json"
MAX_SHARD = "15MB"


def save_state(out: Path, model, optimizer, step: int, config: dict) -> None:
    """Write model + optimizer + step atomically (temp file, fsync, rename)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (STATE_FILE + ".tmp")
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step, "config": config}
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / STATE_FILE)


def load_state(out: Path) -> dict | None:
    """The saved training state, or None when there is none."""
    path = out / STATE_FILE
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None


def export(model: LlamaForCausalLM, dest: Path, step: int, config: dict, history: list[dict] | None = None) -> None:
    """Save bf16 weights in shards of at most 15 MB, the HF config and trainer_state.json
    (with `history`: the earlier stages these weights were trained in, oldest first)."""
    dest.mkdir(parents=True, exist_ok=True)
    shipped = copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16)  # type: ignore[call-arg]
    shipped.save_pretrained(dest, max_shard_size=MAX_SHARD)
    meta: dict = {"step": step, "train_config": config}
    if history:
        meta["history"] = history
    (dest / TRAINER_STATE).write_text(json.dumps(meta, indent=1))


def stage_history(src: Path | None) -> list[dict]:
    """Stages behind an export: its own history, then its last stage ({"step", "train_config"})."""
    meta = src / TRAINER_STATE if src is not None else None
    if meta is None or not meta.exists():
        return []
    data = json.loads(meta.read_text())
    return [*data.get("history", []), {"step": data["step"], "train_config": data["train_config"]}]


def load_export(src: Path, memory: ModelConfig | None = None) -> tuple[LlamaForCausalLM, int]:
    """An exported model in float32, and the step it was exported at. With ``memory`` (a model config with
    ``memory_max_length``) a plain export becomes RAT+: its weights, plus memory gates at their init."""
    from workers.ratplus import RatConfig, RatForCausalLM, has_decaying_memory

    config = AutoConfig.from_pretrained(src)
    model: LlamaForCausalLM
    if memory is not None and memory.memory_max_length is not None and not has_decaying_memory(config):
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version", "dtype")}
        rat = RatConfig(**fields, memory_max_length=memory.memory_max_length, memory_gate_bias=memory.memory_gate_bias)
        model = RatForCausalLM.from_pretrained(src, config=rat, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")  # type: ignore[assignment]
    return model, export_step(src)


def export_step(src: Path) -> int:
    """The step an export was written at (0 when it has no trainer_state.json)."""
    meta = src / TRAINER_STATE
    return json.loads(meta.read_text())["step"] if meta.exists() else 0
