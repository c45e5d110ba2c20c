"""KVzip: keep the KV pairs the model attends most while repeating the context, ranked over all heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from workers.methods.compressed import CompressionMethod, n_keep, top_global
from workers.methods.reconstruct import ReconstructConfig, reconstruction_scores

if TYPE_CHECKING:
    from workers.model import LoadedModel


class KVzip(CompressionMethod):
    """Context-reconstruction scores on every head; the top ``ratio`` of all KV pairs kept, so a head's
    budget follows its scores (non-uniform across heads and layers)."""

    name = "kvzip"
    scorer = "kvzip"

    def __init__(self, config: ReconstructConfig | None = None):
        self.config = config or ReconstructConfig()

    def score(self, lm: LoadedModel, context_ids: Sequence[int],
              kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Maximum reconstruction attention of every KV pair."""
        return reconstruction_scores(lm, context_ids, kv, config=self.config)

    def keep(self, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        """The globally highest-scoring ``ratio`` of KV pairs."""
        assert scores is not None
        return top_global(scores, n_keep(ratio, scores.numel()))
