"""HybridKV: reconstruction scoring on the heads an offline calibration ranked highest; the others pruned."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from store.errors import InvalidInput
from workers.methods.compressed import CompressionMethod, n_keep, top_global
from workers.methods.head_scores import HeadScores
from workers.methods.reconstruct import ReconstructConfig, reconstruction_scores

if TYPE_CHECKING:
    from workers.model import LoadedModel


class HybridKV(CompressionMethod):
    """Algorithm 1 of the paper: the top ``k`` of heads (shipped calibration ranking) are scored by context
    reconstruction and keep the globally highest-scoring KV pairs up to ``ratio`` of the whole cache; the
    pruned heads keep nothing. Above ``ratio = k`` only head pruning runs, with ``k = ratio`` (whole heads)."""

    name = "hybridkv"
    scorer = "hybridkv"

    def __init__(self, heads: HeadScores | None = None, config: ReconstructConfig | None = None):
        self.heads, self.config = heads, config or ReconstructConfig()

    def _ranking(self) -> HeadScores:
        if self.heads is None:
            raise InvalidInput("hybridkv needs the model's head ranking (hybridkv_heads.json beside its weights; "
                               "python -m lab.compress.head_select makes it)")
        return self.heads

    def scores_name(self) -> str | None:
        """The scores depend on which heads were scored: the ranking's digest is part of the name."""
        return f"{self.scorer}.{self._ranking().digest[:12]}.scores.v{self.scorer_version}"

    def needs_scores(self, ratio: float) -> bool:
        """Scores only up to ``k``: above it whole heads are kept by the ranking alone."""
        return ratio <= self._ranking().head_fraction

    def selected(self, fraction: float | None = None) -> torch.Tensor:
        """Mask ``[layers, kv_heads]`` of the retained heads (the top ``k``, or ``fraction``, of the ranking)."""
        ranking = self._ranking()
        return torch.tensor(ranking.top(ranking.head_fraction if fraction is None else fraction), dtype=torch.bool)

    def score(self, lm: LoadedModel, context_ids: Sequence[int],
              kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Reconstruction scores on the retained heads only (0 elsewhere)."""
        if self._ranking().shape != (lm.layout.n_layers, lm.layout.n_kv_heads):
            raise InvalidInput("the head ranking does not match the model's layers and KV heads")
        return reconstruction_scores(lm, context_ids, kv, heads=self.selected(), config=self.config)

    def keep(self, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        """Token-level keep within the retained heads, or whole heads above ``k``."""
        k = self._ranking().head_fraction
        if ratio > k:  # the paper: k matched to the ratio, head pruning only
            heads = self.selected(ratio)
            return heads[:, :, None].expand(n_layers, n_kv_heads, n_tokens).clone()
        assert scores is not None
        eligible = self.selected()[:, :, None].expand_as(scores)
        return top_global(scores, n_keep(ratio, scores.numel()), eligible)
