"""Model fingerprints: a hash of the config and the weights, so two models never share a prefix."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedModel

# Config keys that do not change what the model computes.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_attn_implementation_autoset",
                                  "_attn_implementation", "dtype", "torch_dtype", "architectures"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
NOT_WEIGHTS = frozenset({"lookahead.safetensors", "phi_map.safetensors"})
"""Files beside the weights hashed on their own (their digests are folded in when they are loaded): the
LookaheadKV adapter names the fingerprint of the weights alone, so a mismatched adapter can be refused and
a φ map replaced or removed beside it does not make the adapter look foreign."""
HASH_CHUNK = 1 << 22


def config_digest(config_dict: dict) -> str:
    """Hash of a model config without volatile keys."""
    clean = {k: v for k, v in config_dict.items() if k not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def weight_files_digest(model_dir: Path) -> str | None:
    """Hash of the weight files of a local model directory, or None when it has none."""
    files = sorted(p for p in model_dir.iterdir()
                   if p.suffix in WEIGHT_SUFFIXES and p.name not in NOT_WEIGHTS and p.is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hash of named tensors (names, dtypes and bytes, in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_dict_digest(model: torch.nn.Module) -> str:
    """Hash of a model's parameters and buffers (for models not loaded from local files)."""
    return tensors_digest(model.state_dict())


def model_fingerprint(model: PreTrainedModel, source: str) -> str:
    """Fingerprint of (config, weights); weights are hashed from files when ``source`` is a dir."""
    src = Path(source)
    weights = weight_files_digest(src) if src.is_dir() else None
    if weights is None:
        weights = state_dict_digest(model)
    cfg = config_digest(model.config.to_dict())
    return hashlib.sha256(f"{cfg}:{weights}".encode()).hexdigest()[:32]
