"""Client-side configuration: which model, where the data lives, which device (imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from store.config import default_home
from store.errors import InvalidInput
from workers.model_source import default_device, default_dtype, default_model

if TYPE_CHECKING:
    from workers.offload.config import OffloadConfig

DEVICES = ("cpu", "cuda")
"""Device kinds a client runs on (``cuda:N`` names one GPU)."""


def check_device(device: str) -> str:
    """``device`` when this machine has it; InvalidInput saying what to use instead (probes torch for CUDA)."""
    kind, _, index = device.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise InvalidInput(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InvalidInput(f"device {device!r} asked for, but torch sees no CUDA GPU on this machine "
                               "(use --device cpu, or leave --device out to pick one)")
        if index and int(index) >= torch.cuda.device_count():
            raise InvalidInput(f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Settings of an embedded client; every field has an environment-derived default.

    Building one imports no torch: the device is probed, and the offload settings made, when the worker is.
    """

    home: Path = field(default_factory=default_home)
    model: str | None = None
    """Hub id or local path; None resolves through ``default_model``."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None: cuda when available, else cpu."""
    dtype: str | None = None
    """None: the checkpoint's dtype on GPU, float32 on CPU (bf16 matmuls are slow on CPUs)."""
    tenant: str = "default"
    page_size: int = 16
    progress: bool = True
    offload: OffloadConfig | None | Literal["default"] = "default"
    """Tiered per-step page fetch for sparse methods: ``"default"`` (``OffloadConfig()``), a config, or None
    (read each layer once and hold it)."""

    def resolved_model(self) -> str:
        """The model to load."""
        return self.model or default_model()

    def resolved_device(self) -> str:
        """The device to run on; InvalidInput when the one named is not on this machine."""
        return check_device(self.device) if self.device is not None else default_device()

    def resolved_dtype(self) -> str:
        """The dtype to load the model in."""
        return self.dtype or default_dtype(self.resolved_device())

    def resolved_offload(self) -> OffloadConfig | None:
        """The offload settings the worker gets."""
        if self.offload != "default":
            return self.offload
        from workers.offload.config import OffloadConfig  # the workers.offload package imports torch

        return OffloadConfig()
