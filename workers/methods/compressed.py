"""The interface every query-agnostic compression method implements, and decoding a compressed prefix.

A method scores the stored context once (query-agnostic, ratio-free; stored as the prefix's artifact
``<scorer>.scores.v<n>``), turns the scores into a keep set per layer and KV head at a ratio (budgets
need not be uniform across heads), and the kept tokens' K/V become a compact cache, another artifact of
the prefix (``<method>.r<ratio>.v<n>``). Building runs once per (prefix, method, ratio)
(``workers.compression``); decoding reads only the compact cache.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from store.errors import InvalidInput
from workers.attention import PrefixAttention
from workers.kernels.dense_attention import dense_attention
from workers.methods.base import Method, ReadReport
from workers.methods.compressed_names import cache_artifact, canonical_ratio, scores_artifact
from workers.methods.reads import ReadCounter
from workers.methods.source import PrefixSource
from workers.requests import DecodeConfig

if TYPE_CHECKING:
    from workers.model import LoadedModel

DEFAULT_RATIO = 0.3
"""The kept fraction of the prefix's KV when a request names no ratio."""


class CompressionMethod(Method):
    """A decode method over a compact cache of the prefix: score once, keep per ratio, decode the kept KV."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    """Bumped when the keep rule or the cache format changes (old caches are then rebuilt, not reused)."""
    scorer: ClassVar[str | None] = None
    """Name of the scores artifact's scorer (None: the keep set needs no scores)."""
    scorer_version: ClassVar[int] = 1

    def ratio_of(self, config: DecodeConfig) -> float:
        """The ratio a request decodes at (the default when it names none)."""
        return canonical_ratio(config.ratio if config.ratio is not None else DEFAULT_RATIO)

    def scores_name(self) -> str | None:
        """The scores artifact this method builds from, if any."""
        return None if self.scorer is None else scores_artifact(self.scorer, self.scorer_version)

    def needs_scores(self, ratio: float) -> bool:
        """Whether the keep set at ``ratio`` is built from the scores artifact."""
        return self.scorer is not None

    def cache_name(self, ratio: float) -> str:
        """The compact-cache artifact at ``ratio``."""
        return cache_artifact(self.name, ratio, self.version)

    def base_method(self) -> CompressionMethod | None:
        """The method whose compact cache this one decodes and builds its own artifact from (None: it keeps its
        own cache; the recall tier builds on KVzip's)."""
        return None

    def derive(self, cache: dict[str, torch.Tensor], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
               page_size: int) -> dict[str, torch.Tensor]:
        """This method's artifact from the base's compact ``cache`` and the prefix's layers (only where
        ``base_method`` is set)."""
        raise NotImplementedError(f"{self.name} builds on no other cache")

    def score(self, lm: LoadedModel, context_ids: Sequence[int],
              kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Query-agnostic scores ``[layers, kv_heads, n_tokens]`` float32 (only when ``scorer`` is set)."""
        raise NotImplementedError(f"{self.name} has no scorer")

    @abc.abstractmethod
    def keep(self, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        """Keep mask ``[layers, kv_heads, n_tokens]`` bool keeping about ``ratio`` of all KV pairs."""

    def cache(self, source: PrefixSource, config: DecodeConfig) -> dict[str, torch.Tensor]:
        """This method's artifact at the request's ratio (built beforehand by the worker)."""
        name = self.cache_name(self.ratio_of(config))
        if source.manifest.artifact(name) is None:
            raise InvalidInput(f"prefix {source.manifest.prefix_id} has no compressed cache {name!r} "
                               "(the worker builds it on first use)")
        return source.artifact(name)

    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """Decode over the compact cache at the request's ratio."""
        return CompressedPrefixAttention(source, self.cache(source, config))


def n_keep(ratio: float, total: int) -> int:
    """How many of ``total`` KV pairs a ratio keeps (at least one)."""
    return max(1, min(total, math.ceil(ratio * total - 1e-9)))


def top_global(scores: torch.Tensor, count: int, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Keep mask of the ``count`` highest scores over all layers and heads (non-uniform head budgets:
    KVzip's ranking), only among ``eligible`` entries when given."""
    flat = scores.float().flatten().clone()
    if eligible is not None:
        flat[~eligible.flatten()] = -math.inf
        count = min(count, int(eligible.sum()))
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if count > 0:
        keep[torch.topk(flat, count, sorted=False).indices] = True
    return keep.view(scores.shape)


def compact_cache(keep: torch.Tensor, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The compact cache's tensors: per layer ``{l}.k``, ``{l}.v`` ``[kept, head_dim]`` (heads one after the
    other), ``{l}.idx`` int32 token positions and ``{l}.counts`` int32 ``[kv_heads]``."""
    out: dict[str, torch.Tensor] = {}
    for layer, (k, v) in enumerate(kv):
        mask = keep[layer].to(k.device)
        out[f"{layer}.k"] = k[mask].contiguous()  # row-major over [heads, tokens]: head by head, in order
        out[f"{layer}.v"] = v[mask].contiguous()
        out[f"{layer}.idx"] = torch.nonzero(mask)[:, 1].to(torch.int32)
        out[f"{layer}.counts"] = mask.sum(dim=1).to(torch.int32)
    return out


class CompressedPrefixAttention:
    """Exact attention over each KV head's kept tokens (their number differs from head to head); every step
    reads the whole compact cache, counted like ``full`` counts the whole prefix."""

    def __init__(self, source: PrefixSource, cache: dict[str, torch.Tensor]):
        lay = source.layout
        self.n_kv_heads = lay.n_kv_heads
        self.layers: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
        for layer in range(lay.n_layers):
            counts = [int(c) for c in cache[f"{layer}.counts"].tolist()]
            self.layers.append((cache[f"{layer}.k"], cache[f"{layer}.v"], counts))
        self.kept = [sum(c) for _, _, c in self.layers]
        self.counter = ReadCounter(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads,
                                   token_bytes=lay.token_kv_bytes())
        full = source.n_tokens * lay.n_layers * lay.n_kv_heads
        self.counter.info["kept_fraction"] = sum(self.kept) / max(1, full)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` -> (out, lse) over the layer's kept tokens, head by head."""
        if layer == 0:
            self.counter.start_step()
        k, v, counts = self.layers[layer]
        self.counter.add_layer(self.kept[layer])
        g = q.shape[1] // self.n_kv_heads
        outs, lses = [], []
        start = 0
        for h, c in enumerate(counts):
            kh, vh = k[start:start + c][None, None], v[start:start + c][None, None]
            o, lse = dense_attention(q[:, h * g:(h + 1) * g], kh, vh, scale)
            outs.append(o)
            lses.append(lse)
            start += c
        return torch.cat(outs, dim=1), torch.cat(lses, dim=1)

    def read_report(self) -> ReadReport:
        """The kept tokens of every layer and KV head, each step."""
        return self.counter.report()
