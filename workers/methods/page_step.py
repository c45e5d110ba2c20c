"""Page-granular sparse steps: whole pages picked with fixed shapes, so a decode step needs no device sync.

When a selector picks whole pages of the store's page size (Quest) under a fixed budget, every
row attends the mid tokens of the ``n_pages`` best pages overlapping the mid region
(``select_pages``) and the sink and tail tokens exactly, as the token-granular Quest does.

Entries are the picked pages' tokens, then the anchor tokens in ascending order; tokens of a
picked page outside the mid region (a boundary page's anchors, or past the prefix) get bias
``-inf`` instead of being compacted away. The shapes depend
on the budget only, so for one row selection, the fetch of the picked and anchor pages
(``LayerKV.step_pages``: the device-planned cache when the prefix is warm) and the kernel run
without a device -> host copy; rows of the first forward fetch the same entries together.
Resident and offloaded decoding attend the same entries in the same order. A single row's entries
come from one kernel launch (``workers.kernels.page_entries``, bit-equal to ``entry_tokens`` and
``entry_bias`` here, which serve the rows of a first forward; their pool rows come from ``LayerKV.step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.methods.layer_kv import page_tokens
from workers.pages import page_of, page_span


@dataclass(frozen=True)
class PagePlan:
    """The page-granular layout of one layer's steps."""

    page_size: int
    lo: int
    hi: int
    """The mid region ``[lo, hi)``."""
    first_page: int
    """First page overlapping the mid region."""
    end_page: int
    """One past the last such page."""
    n_pages: int
    """Pages picked per row: ``k // page_size`` (every candidate once ``k`` covers the mid region)."""
    anchor_pages: torch.Tensor
    """``[Hkv, na]`` the pages holding anchor tokens, ascending."""
    anchor_slot: torch.Tensor
    """``[n_anchor]`` for each anchor token, its page's position in ``anchor_pages``."""
    anchor_offset: torch.Tensor
    """``[n_anchor]`` its offset inside that page."""
    anchors: torch.Tensor
    """``[n_anchor]`` the anchor token ids, ascending."""

    @property
    def n_entries(self) -> int:
        """Entries per row: picked tokens plus anchors."""
        return self.n_pages * self.page_size + self.anchors.numel()


def page_plan(*, anchors: torch.Tensor, lo: int, hi: int, page_size: int, k: int, n_heads: int) -> PagePlan:
    """The plan of a layer whose mid region is ``[lo, hi)`` and exact anchors ``anchors`` (ascending)."""
    p = page_size
    first, end = page_span(lo, hi, p)
    end = max(first, end)
    n_pages = end - first if k >= hi - lo else max(0, min(k // p, end - first))
    pages_of = page_of(anchors, p)
    uniq, slot = torch.unique(pages_of, return_inverse=True)
    return PagePlan(page_size=p, lo=lo, hi=hi, first_page=first, end_page=end, n_pages=n_pages,
                    anchor_pages=uniq.expand(n_heads, -1).contiguous(), anchor_slot=slot,
                    anchor_offset=anchors - pages_of * p, anchors=anchors)


def step_pages(plan: PagePlan, picked: torch.Tensor) -> torch.Tensor:
    """Picked pages ``[Hkv, n]`` -> the pages one row fetches: picked, then the anchor pages."""
    return torch.cat([picked, plan.anchor_pages], dim=1)


def entry_tokens(plan: PagePlan, picked: torch.Tensor) -> torch.Tensor:
    """Picked pages ``[T, Hkv, n]`` -> the token ids of the entries ``[T, Hkv, n_entries]``."""
    t, h, _ = picked.shape
    return torch.cat([page_tokens(picked * plan.page_size, plan.page_size), plan.anchors.expand(t, h, -1)], dim=-1)


def entry_bias(plan: PagePlan, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry token ids ``[T, Hkv, n_entries]`` -> (additive bias: 0, or ``-inf`` for a picked page's token
    outside the mid region; ``[T, Hkv, n_picked]`` bool: which picked tokens are mid tokens)."""
    n = plan.n_pages * plan.page_size
    picked = tokens[..., :n]
    in_mid = (picked >= plan.lo) & (picked < plan.hi)
    bias = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    bias[..., :n].masked_fill_(~in_mid, float("-inf"))
    return bias, in_mid
