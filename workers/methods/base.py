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

from workers.attention import PrefixAttention
from workers.methods.source import PrefixSource
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
    """Bytes the steps read: those tokens' K and V plus selection's key-only reads (whole pages when a page
    fetcher served them); ``methods/reads.py`` defines the accounting."""
    once_bytes: int = 0
    """Bytes read once per generation: summaries and indexes (bounds, key index, clusters, φ cache) and
    selector-resident keys."""
    once_kv_bytes: int = 0
    """The part of ``once_bytes`` that is prefix K/V (keys a selector holds resident, e.g. Top-K's)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Named counters for ``GenerationStats.extra`` (token equivalents, pseudo-entries, budgets)."""


@runtime_checkable
class ReportsReads(Protocol):
    """A ``PrefixAttention`` that counts its own reads (sparse methods); others read whole layers."""

    def read_report(self) -> ReadReport:
        """The reads made so far in this generation."""
        ...


@runtime_checkable
class UsesCudaGraphs(Protocol):
    """A ``PrefixAttention`` that can replay its fixed-shape decode steps from CUDA graphs."""

    def use_cuda_graphs(self) -> None:
        """Capture and replay its decode steps from now on (where they have fixed shapes)."""
        ...


class Summarizer(abc.ABC):
    """Prefill-time summary of each layer's K/V (stored as the artifact ``name``)."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    late: ClassVar[bool] = False
    """Whether a prefill may leave this summary for after its commit (``workers.late_summaries``): true for the
    costly ones, which would otherwise hold every prefill (at 128k on an H200, Double-P's k-means and the φ cache
    are 96 % of the summaries' time, 0.3x of the forward pass)."""

    @abc.abstractmethod
    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K, V ``[kv_heads, n_tokens, head_dim]`` -> named tensors for this layer."""


class Method(abc.ABC):
    """A decode method: which summaries it needs, and how it attends over the prefix."""

    name: ClassVar[str]
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = ()
    fetches_pages: ClassVar[bool] = False
    """Whether it reads the prefix through ``PrefixSource.layer`` (so a page fetcher serves it per step) or
    ``PrefixSource.whole_layer`` (the tiers serve its whole-layer reads): the worker then opens a fetcher."""
    fast_open: ClassVar[bool] = True
    """With ``fetches_pages``: whether the worker also opens ``FastOpen`` for it (the host tier warmed in the
    background, a device-planned page cache once warm). False for a method that reads every layer whole when
    it opens (``full``): its own reads fill the host tier, and it would never use a page cache."""

    def reads_summaries(self) -> tuple[type[Summarizer], ...]:
        """The summaries this configured method reads (a generation waits for the late ones among them)."""
        return self.summarizers

    @abc.abstractmethod
    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """Decode-time state for one generation over ``source``."""
