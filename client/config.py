"""Client-side configuration: which model, where the data lives, which device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from store.config import default_home
from workers.offload.config import OffloadConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODELS_DIR = REPO_ROOT / "models"
SHIPPED_MODEL_NAME = "kvstash-tiny"
"""The project's own trained model (models/<name>), the default once it is shipped."""
FALLBACK_MODEL_NAME = "tiny-random-llama"
"""A random-weight model built on first use when no trained model is shipped (tests, bare checkouts)."""

log = logging.getLogger(__name__)


def default_model(home: Path) -> str:
    """``$KVSTASH_MODEL``, else the shipped trained model, else a random tiny model built in ``home``."""
    if env := os.environ.get("KVSTASH_MODEL"):
        return env
    shipped = SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME
    if (shipped / "config.json").is_file():
        return str(shipped)
    fallback = home / "models" / FALLBACK_MODEL_NAME
    if not (fallback / "config.json").is_file():
        from lab.tiny_random import build_tiny_llama

        log.warning("no trained model shipped in %s; building a random-weight model at %s", shipped, fallback)
        build_tiny_llama(fallback)
    return str(fallback)


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Settings of an embedded client; every field has an environment-derived default."""

    home: Path = field(default_factory=default_home)
    model: str | None = None
    """Hub id or local path; None resolves through ``default_model``."""
    device: str = field(default_factory=default_device)
    dtype: str | None = None
    """None: the checkpoint's dtype on GPU, float32 on CPU (bf16 matmuls are slow on CPUs)."""
    tenant: str = "default"
    page_size: int = 16
    progress: bool = True
    offload: OffloadConfig | None = field(default_factory=OffloadConfig)
    """Tiered per-step page fetch for sparse methods (None: read each layer once and hold it)."""

    def resolved_model(self) -> str:
        """The model to load."""
        return self.model or default_model(self.home)

    def resolved_dtype(self) -> str:
        """The dtype to load the model in."""
        if self.dtype:
            return self.dtype
        return "float32" if self.device == "cpu" else "auto"
