"""What Double-P's per-step bookkeeping returns (``ops.doublep_select`` and its reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DoublePPick:
    """One step's picks per row (rows: query token, then KV head)."""

    tokens: torch.Tensor
    """``[R, width]`` int64: the exact clusters' token ids ascending, then the pad id."""
    counts: torch.Tensor
    """``[R]`` int64 exact tokens per row."""
    n_ids: int
    """Exact tokens in all."""
    n_exact: int
    """Exact clusters in all."""
    centroids: torch.Tensor | None = None
    """``[R, cwidth]`` int64 approximated cluster ids ascending (then other ids); None without the fallback."""
    n_centroids: torch.Tensor | None = None
    """``[R]`` int64 approximated clusters per row."""
    n_approx: int = 0
    """Approximated clusters in all."""
