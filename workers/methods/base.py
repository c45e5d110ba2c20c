"""The small interfaces every sparse or compression method implements.

- ``Summarizer.summarize``: prefill time, per layer, K/V -> tensors stored as an artifact.
- ``Method.open``: decode time, returns the ``PrefixAttention`` the model's attention hook calls.
A new method is one file: a ``Method`` subclass (plus its summarizer) added to the registry.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch

from store.artifacts import bytes_to_tensors
from store.kvstore import KVStore
from store.layout import KVLayout
from store.manifest import Manifest
from workers.attention import PrefixAttention
from workers.methods.layer_kv import FetchedKV, LayerKV, ResidentKV
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher
from workers.requests import DecodeConfig


def mid_range(n_tokens: int, sink: int, tail: int) -> tuple[int, int]:
    """The mid region ``[lo, hi)`` between the sink and tail anchors (empty when they cover everything)."""
    lo = min(sink, n_tokens)
    return lo, max(lo, n_tokens - tail)


@dataclass(kw_only=True)
class ReadReport:
    """What a decode method read from the prefix over one generation (honest per-step accounting)."""

    tokens_per_step: list[int] = field(default_factory=list)
    """Exact prefix tokens whose K/V each step attended, summed over layers and KV heads."""
    step_bytes: int = 0
    """Bytes of those tokens' K and V over all steps (as if each step fetched them)."""
    once_bytes: int = 0
    """Bytes read once per generation: summaries (bounds, clusters, φ cache) and selector-resident keys."""
    once_kv_bytes: int = 0
    """The part of ``once_bytes`` that is prefix K/V (keys a selector holds resident, e.g. Top-K's)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Named counters for ``GenerationStats.extra`` (token equivalents, pseudo-entries, budgets)."""

    @property
    def bytes_total(self) -> int:
        """Everything read: per-step KV plus one-time reads."""
        return self.step_bytes + self.once_bytes


@runtime_checkable
class ReportsReads(Protocol):
    """A ``PrefixAttention`` that counts its own reads (sparse methods); others read whole layers."""

    def read_report(self) -> ReadReport:
        """The reads made so far in this generation."""
        ...


class PrefixSource:
    """Read access to one stored prefix on one device, counting the bytes it reads.

    With a ``fetcher`` (offloaded decode), sparse methods fetch per step only the pages they attend;
    without one, they read each layer once and hold it.
    """

    def __init__(self, store: KVStore, manifest: Manifest, device: torch.device, *, verify: bool = True,
                 fetcher: PageFetcher | None = None, device_cache: DevicePageCache | None = None):
        self.store, self.manifest, self.device = store, manifest, device
        self.verify = verify
        """Check each page's keyed CRC on read: corrupt or misplaced bytes fail the request, never decode."""
        self.fetcher = fetcher
        self.device_cache = device_cache
        """Device-planned fetches of a warm prefix (steps that fit it; the fetcher serves the rest)."""
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

    def layer(self, layer: int) -> LayerKV:
        """Decode-time access to one layer: fetched per step through the fetcher, else read and held."""
        if self.fetcher is not None:
            return FetchedKV(self, self.fetcher, layer)
        return ResidentKV(*self.layer_kv(layer), page_size=self.layout.page_size)

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
    fetches_pages: ClassVar[bool] = False
    """Whether it reads the prefix through ``PrefixSource.layer`` (so a page fetcher serves it per step)."""

    @abc.abstractmethod
    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """Decode-time state for one generation over ``source``."""
