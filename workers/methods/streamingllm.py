"""StreamingLLM: attention sinks plus a recent window, the same for every layer and head."""

from __future__ import annotations

from typing import ClassVar

import torch

from workers.methods.compressed import CompressionMethod, n_keep

SINK_TOKENS = 4
"""Leading tokens always kept (the attention sinks)."""


class StreamingLLM(CompressionMethod):
    """The first ``SINK_TOKENS`` tokens and the most recent ones, ``ratio`` of the prefix in all."""

    name = "streamingllm"
    sink: ClassVar[int] = SINK_TOKENS

    def keep(self, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        """Sinks and a recent window, uniform across layers and heads."""
        kept = n_keep(ratio, n_tokens)
        sink = min(self.sink, kept)
        mask = torch.zeros(n_tokens, dtype=torch.bool)
        mask[:sink] = True
        mask[n_tokens - (kept - sink):] = True
        return mask.expand(n_layers, n_kv_heads, n_tokens).clone()
