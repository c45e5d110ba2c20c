"""What ``page_entries`` returns: one row's attention entries over whole picked pages plus anchor tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PageEntries"]


@dataclass(frozen=True)
class PageEntries:
    """The entries of one row (``E = n * page_size + n_anchor`` per KV head: the picked pages' tokens, page by
    page, then the anchor tokens)."""

    rows: torch.Tensor
    """``[1, Hkv, E]`` int64 pool row of each entry, clamped to ``[0, pool_rows - 1]``."""
    bias: torch.Tensor
    """``[1, Hkv, E]`` float32 additive bias: ``-inf`` for a picked page's token outside ``[lo, hi)``, else 0."""
    tokens: torch.Tensor
    """``[1, Hkv, n * page_size]`` int64 token ids of the picked entries, clamped to ``[lo, max(lo, hi - 1)]``
    (an out-of-mid id becomes a duplicate of a mid token of its page)."""
    n_distinct: torch.Tensor
    """0-dim int64: picked tokens inside ``[lo, hi)`` over all heads (pages are distinct per head)."""
    mid_rows: torch.Tensor | None = None
    """``[1, Hkv, n * page_size]`` int64 contiguous: ``rows[..., :n * page_size]`` (the CPU kernel only, else None)."""
    valid: torch.Tensor | None = None
    """``[1, Hkv, n * page_size]`` bool contiguous: ``bias[..., :n * page_size] == 0`` (the CPU kernel only)."""
