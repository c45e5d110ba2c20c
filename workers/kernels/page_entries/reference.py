"""Torch reference of a single row's page entries (the CPU path, and the Triton kernel's oracle).

The same ops as the page step ran before the kernel (``page_step.entry_tokens``, ``entry_bias``,
``entry_rows``, then the clamps and the mid count), written against plain tensors.
"""

from __future__ import annotations

import torch

from .entries import PageEntries

__all__ = ["page_entries_ref"]


def _page_rows(first: torch.Tensor, page_size: int) -> torch.Tensor:
    """First rows (or ids) of pages ``[Hkv, n]`` -> every row of those pages ``[Hkv, n * page_size]``."""
    return (first.unsqueeze(-1) + torch.arange(page_size, device=first.device)).flatten(-2)


def page_entries_ref(picked: torch.Tensor, first_rows: torch.Tensor, anchor_slot: torch.Tensor,
                     anchor_offset: torch.Tensor, *, page_size: int, lo: int, hi: int, pool_rows: int) -> PageEntries:
    """The entries of one row (semantics: ``ops.page_entries``)."""
    n = picked.shape[1]
    tokens = _page_rows(picked * page_size, page_size)
    in_mid = (tokens >= lo) & (tokens < hi)
    anchor = first_rows[:, n:].index_select(1, anchor_slot) + anchor_offset
    rows = torch.cat([_page_rows(first_rows[:, :n], page_size), anchor], dim=1).clamp(0, pool_rows - 1)
    bias = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    bias[:, : tokens.shape[1]].masked_fill_(~in_mid, float("-inf"))
    return PageEntries(rows=rows[None], bias=bias[None], tokens=tokens.clamp(lo, max(lo, hi - 1))[None],
                       n_distinct=in_mid.sum())
