"""Exact attention over every prefix token: the accuracy reference and fetch-everything baseline."""

from __future__ import annotations

import torch

from workers.attention import PrefixAttention
from workers.kernels.dense_attention import dense_attention
from workers.methods.base import Method, ReadReport
from workers.methods.reads import ReadCounter
from workers.methods.source import PrefixSource
from workers.methods.sparse import offload_counters
from workers.requests import DecodeConfig


class FullPrefixAttention:
    """Attends every prefix token at every step; reads are counted as a fetch-everything decoder
    makes them (all of a layer's K/V per step), even though this in-process path keeps them resident."""

    def __init__(self, source: PrefixSource):
        self.source = source
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        lay = source.layout
        self.counter = ReadCounter(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, token_bytes=lay.token_kv_bytes())

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention of q ``[B, Hq, L, D]`` over the layer's prefix (a fused kernel: flash on CUDA)."""
        if layer not in self._kv:
            self._kv[layer] = self.source.whole_layer(layer)
        if layer == 0:
            self.counter.start_step()
        k, v = self._kv[layer]
        self.counter.add_layer(k.shape[0] * k.shape[1])
        return dense_attention(q, k[None], v[None], scale)

    # -- a whole model step captured in one CUDA graph (workers.step_graph) --------------------------------
    def graph_key(self) -> object | None:
        """Always capturable once every layer is resident: fixed shapes, no host work."""
        n = self.source.layout.n_layers
        return ("full", id(self)) if len(self._kv) == n else None

    def graph_attend(self, layer: int, q: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Exact attention of one query row over the resident layer."""
        k, v = self._kv[layer]
        out, lse = dense_attention(q, k[None], v[None], scale)
        return out, lse, None

    def account_step(self, reads: torch.Tensor | None) -> None:
        """Every layer's prefix tokens, as ``attend`` counts them."""
        self.counter.start_step()
        self.counter.add_layer(sum(k.shape[0] * k.shape[1] for k, _ in self._kv.values()))

    def read_report(self) -> ReadReport:
        """All prefix tokens of every layer and KV head, each step (the ``offload_*`` counters say which tiers
        the whole-layer reads at open came from)."""
        report = self.counter.report()
        if (fetcher := self.source.fetcher) is not None:
            report.extra.update(offload_counters(fetcher, None, len(report.tokens_per_step)))
        return report


class FullAttention(Method):
    """Every prefix token, exactly."""

    name = "full"
    # Its whole-layer reads at open go through the worker's tiers: a question over a hot prefix copies from the
    # pinned host tier instead of reading and CRC-checking every page file again; cold pages read fill the tier.
    fetches_pages = True
    fast_open = False

    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """State for one generation, every layer's K/V read (the opener pays, not a shared decode step)."""
        attn = FullPrefixAttention(source)
        for layer in range(source.layout.n_layers):
            attn._kv[layer] = source.whole_layer(layer, step=0)
        return attn
