"""LookaheadKV's trained parts: lookahead token embeddings and LoRA adapters active only on those tokens.

The adapters hang on the model's linear projections as forward hooks (the model's weights and
state dict stay untouched). They add ``x A B * alpha / r`` only where the thread's current
lookahead mask is set (``active``): every other position's output is the base layer's, bit for bit.
Shipped beside the weights as ``lookahead.safetensors`` + ``lookahead.json`` (config, the base
model's fingerprint, training steps and loss).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.fingerprint import tensors_digest

LOOKAHEAD_WEIGHTS = "lookahead.safetensors"
LOOKAHEAD_INFO = "lookahead.json"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear of a Llama-style decoder layer (the paper applies Lookahead LoRA to all of them)."""
EMBEDDINGS = "embeddings"


@dataclass(frozen=True, kw_only=True)
class LookaheadConfig:
    """Shape of the lookahead parts (the paper's defaults: 32 tokens, rank 8, alpha 32, all linears)."""

    n_lookahead: int = 32
    rank: int = 8
    alpha: float = 32.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.n_lookahead < 1 or self.rank < 1 or self.alpha <= 0 or not self.targets:
            raise ValueError("need n_lookahead >= 1, rank >= 1, alpha > 0 and at least one target")

    @property
    def scaling(self) -> float:
        """LoRA's output scale ``alpha / rank``."""
        return self.alpha / self.rank


def _key(module_name: str) -> str:
    return module_name.replace(".", "__")


class LookaheadAdapter(nn.Module):
    """Lookahead embeddings ``[n, hidden]`` and one LoRA pair per targeted linear, hooked into ``model``."""

    def __init__(self, model: nn.Module, config: LookaheadConfig | None = None, *, seed: int = 0):
        super().__init__()
        self.config = cfg = config or LookaheadConfig()
        emb = model.get_input_embeddings().weight  # type: ignore[operator]
        gen = torch.Generator().manual_seed(seed)
        std = float(emb.detach().float().std())  # new tokens start at the scale of the model's embeddings
        self.embeddings = nn.Parameter(torch.randn(cfg.n_lookahead, emb.shape[1], generator=gen) * std)
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        self._targets: dict[str, nn.Linear] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.targets:
                a = torch.randn(mod.in_features, cfg.rank, generator=gen) / mod.in_features ** 0.5
                self.lora_a[_key(name)] = nn.Parameter(a)
                self.lora_b[_key(name)] = nn.Parameter(torch.zeros(cfg.rank, mod.out_features))  # starts as a no-op
                self._targets[name] = mod
        if not self._targets:
            raise ValueError(f"the model has no linear layers named {cfg.targets}")
        self.to(emb.device)
        self._local = threading.local()
        self._hooks = [mod.register_forward_hook(self._hook(_key(name))) for name, mod in self._targets.items()]

    def _hook(self, key: str):  # noqa: ANN202 - a torch forward hook
        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            mask = getattr(self._local, "mask", None)
            if mask is None:
                return None
            a, b = self.lora_a[key], self.lora_b[key]
            delta = (inputs[0].to(a.dtype) @ a) @ b * self.config.scaling
            return torch.where(mask.unsqueeze(-1), out + delta.to(out.dtype), out)
        return add_lora

    @contextlib.contextmanager
    def active(self, mask: torch.Tensor) -> Iterator[None]:
        """Adapters on at the positions where ``mask [B, T]`` is True, in this thread, for the block."""
        before = getattr(self._local, "mask", None)
        self._local.mask = mask.bool()
        try:
            yield
        finally:
            self._local.mask = before

    def detach_hooks(self) -> None:
        """Remove the hooks from the model (the adapter no longer touches it)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every trained tensor by name (what ``lookahead.safetensors`` holds)."""
        out = {EMBEDDINGS: self.embeddings.detach()}
        out.update({f"lora_a.{k}": p.detach() for k, p in self.lora_a.items()})
        out.update({f"lora_b.{k}": p.detach() for k, p in self.lora_b.items()})
        return {k: t.float().cpu().contiguous() for k, t in out.items()}

    @property
    def digest(self) -> str:
        """Hash of the config and the trained tensors (folded into the model fingerprint)."""
        config = json.dumps(asdict(self.config), sort_keys=True)
        return hashlib.sha256(f"{config}:{tensors_digest(self.tensors())}".encode()).hexdigest()

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take trained tensors (names and shapes must match this model's adapter exactly)."""
        mine = self.tensors()
        if set(tensors) != set(mine):
            missing, unexpected = sorted(set(mine) - set(tensors))[:3], sorted(set(tensors) - set(mine))[:3]
            raise ValueError(f"lookahead tensors do not match this model: missing {missing}, unexpected {unexpected}")
        bad = [k for k, t in tensors.items() if t.shape != mine[k].shape]
        if bad:
            raise ValueError(f"lookahead tensor {bad[0]} has shape {tuple(tensors[bad[0]].shape)}, this model needs "
                             f"{tuple(mine[bad[0]].shape)}")
        with torch.no_grad():
            self.embeddings.copy_(tensors[EMBEDDINGS])
            for k in self.lora_a:
                self.lora_a[k].copy_(tensors[f"lora_a.{k}"])
                self.lora_b[k].copy_(tensors[f"lora_b.{k}"])


def save_adapter(adapter: LookaheadAdapter, model_dir: Path, *, base_fingerprint: str,
                 info: dict[str, Any]) -> None:
    """Write ``lookahead.safetensors`` and ``lookahead.json`` (config, base model, ``info``) into ``model_dir``."""
    save_file(adapter.tensors(), str(model_dir / LOOKAHEAD_WEIGHTS))
    meta = {"config": {**asdict(adapter.config), "targets": list(adapter.config.targets)},
            "base_fingerprint": base_fingerprint, "digest": adapter.digest, **info}
    (model_dir / LOOKAHEAD_INFO).write_text(json.dumps(meta, indent=2) + "\n")


class AdapterMismatch(ValueError):
    """A lookahead adapter trained for another model (or damaged)."""


def load_adapter(model_dir: Path, model: nn.Module, base_fingerprint: str) -> LookaheadAdapter | None:
    """The adapter shipped in ``model_dir`` hooked into ``model`` (None when there is none); refuses one
    trained for another model."""
    weights, info_path = model_dir / LOOKAHEAD_WEIGHTS, model_dir / LOOKAHEAD_INFO
    if not weights.is_file():
        return None
    if not info_path.is_file():
        raise AdapterMismatch(f"{weights} has no {LOOKAHEAD_INFO} beside it (config and base model unknown)")
    info = json.loads(info_path.read_text())
    if info.get("base_fingerprint") != base_fingerprint:
        raise AdapterMismatch(f"{weights} was trained for model fingerprint {info.get('base_fingerprint')}; "
                              f"the model in {model_dir} has fingerprint {base_fingerprint} (retrain it with "
                              "`python -m lab.train.lookahead` or remove it)")
    cfg = info["config"]
    config = LookaheadConfig(n_lookahead=cfg["n_lookahead"], rank=cfg["rank"], alpha=cfg["alpha"],
                             targets=tuple(cfg["targets"]))
    adapter = LookaheadAdapter(model, config)
    try:
        adapter.load_tensors(load_file(str(weights)))
    except ValueError as e:
        adapter.detach_hooks()
        raise AdapterMismatch(f"{weights}: {e}") from None
    adapter.requires_grad_(False)
    return adapter
