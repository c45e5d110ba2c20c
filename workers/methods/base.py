"""The small interfaces every sparse or compression method implements.

- ``Summarizer.summarize``: prefill time, per layer, K/V -> tensors stored as an artifact.
- ``Method.open``: decode time, returns the ``PrefixAttention`` the model's attention hook calls.
A new method is one file: a ``Method`` subclass (plus its summarizer) added to the registry.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from store.artifacts import bytes_to_tensors
from store.kvstore import KVStore
from store.layout import KVLayout
from store.manifest import Manifest
from workers.attention import PrefixAttention


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Per-request decode settings shared by every method."""

    budget: float | None = None
    """Token-equivalent reads per step as a fraction of the prefix (None: the method's default)."""
    sink: int = 4
    """Leading prefix tokens always attended exactly."""
    tail: int = 16
    """Trailing prefix tokens always attended exactly."""

    def __post_init__(self) -> None:
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if self.sink < 0 or self.tail < 0:
            raise ValueError("sink and tail must be >= 0")


class PrefixSource:
    """Read access to one stored prefix on one device, counting the bytes it reads."""

    def __init__(self, store: KVStore, manifest: Manifest, device: torch.device, *, verify: bool = True):
        self.store, self.manifest, self.device = store, manifest, device
        self.verify = verify
        """Check each page's keyed CRC on read: corrupt or misplaced bytes fail the request, never decode."""
        self.bytes_read = 0

    @property
    def layout(self) -> KVLayout:
        """The prefix's KV layout."""
        return self.manifest.layout

    @property
    def n_tokens(self) -> int:
        """Tokens in the prefix."""
        return self.manifest.n_tokens

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K, V ``[kv_heads, n_tokens, head_dim]`` on the device."""
        k, v = self.store.read_layer(self.manifest.prefix_id, layer, manifest=self.manifest, verify=self.verify)
        self.bytes_read += 2 * k.numel() * k.element_size()
        return k.to(self.device), v.to(self.device)

    def artifact(self, name: str) -> dict[str, torch.Tensor]:
        """An artifact's tensors (checksum-verified) on the device."""
        data = self.store.artifact(self.manifest.prefix_id, name)
        self.bytes_read += len(data)
        return {k: t.to(self.device) for k, t in bytes_to_tensors(data).items()}


class Summarizer(abc.ABC):
    """Prefill-time summary of each layer's K/V (stored as the artifact ``name``)."""

    name: ClassVar[str]
    version: ClassVar[int] = 1

    @abc.abstractmethod
    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K, V ``[kv_heads, n_tokens, head_dim]`` -> named tensors for this layer."""


class Method(abc.ABC):
    """A decode method: which summaries it needs, and how it attends over the prefix."""

    name: ClassVar[str]
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = ()

    @abc.abstractmethod
    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """Decode-time state for one generation over ``source``."""
