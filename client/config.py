"""Client-side configuration: which model, where the data lives, which device (imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from store.config import default_home
from workers.model_source import default_device, default_dtype, default_model

if TYPE_CHECKING:
    from workers.offload.config import OffloadConfig


def _default_offload() -> OffloadConfig:
    from workers.offload.config import OffloadConfig  # the workers.offload package imports torch

    return OffloadConfig()


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
    offload: OffloadConfig | None = field(default_factory=_default_offload)
    """Tiered per-step page fetch for sparse methods (None: read each layer once and hold it)."""

    def resolved_model(self) -> str:
        """The model to load."""
        return self.model or default_model()

    def resolved_dtype(self) -> str:
        """The dtype to load the model in."""
        return self.dtype or default_dtype(self.device)
