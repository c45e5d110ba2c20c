"""Exact attention over every prefix token: the accuracy reference and fetch-everything baseline."""

from __future__ import annotations

import torch

from workers.attention import PrefixAttention, dense_attention
from workers.methods.base import DecodeConfig, Method, PrefixSource


class FullPrefixAttention:
    """Reads each layer's whole KV once per generation and attends all of it."""

    def __init__(self, source: PrefixSource):
        self.source = source
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention of q ``[B, Hq, L, D]`` over the layer's prefix."""
        if layer not in self._kv:
            self._kv[layer] = self.source.layer_kv(layer)
        k, v = self._kv[layer]
        return dense_attention(q, k[None], v[None], scale)


class FullAttention(Method):
    """Every prefix token, exactly."""

    name = "full"

    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """State for one generation."""
        return FullPrefixAttention(source)
