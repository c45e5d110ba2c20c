"""MoBA (Lu et al. 2025) as a decode method: blocks ranked by their mean-pooled key, within Quest's budget.

Prefill stores each ``MOBA_BLOCK``-token block's mean key (``MobaBlocks``). At decode time a block's
score for a query head is ``scale · q . mean(K_block)``; a KV head's blocks are ranked by the group's
softmax over these scores (every query head of the group has an equal say) and taken best-first while
their mid tokens fit the budget, exactly as Quest takes pages. MoBA's always-attended first and local
blocks are the method's sink and tail anchors.

Training-free, a block mean dilutes a key that matters alone (a needle held by one token adds only 1/64 of
its logit's excess to its block's score): on the shipped tiny models MoBA misses NIAH needles that Quest's bounds
keep (``docs/benchmarks/ratplus.md``, ``bench/bench_selection_recall.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from workers.methods.base import Summarizer
from workers.methods.quest import QuestSelector
from workers.methods.selector import Selector
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.pages import page_count
from workers.requests import DecodeConfig

MOBA_BLOCK = 64
"""Tokens per block (the paper's main setting)."""


class MobaBlocks(Summarizer):
    """Prefill: the mean key of each ``block``-token block (artifact ``block_means``)."""

    name = "block_means"
    version = 1
    block = MOBA_BLOCK

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K ``[Hkv, N, D]`` -> ``kmean`` ``[Hkv, blocks, D]`` (K's dtype; the last block averages the tokens it
        has) and ``meta = [block]``."""
        h, n, d = k.shape
        b = self.block
        blocks = page_count(n, b)
        padded = torch.cat([k.float(), k.new_zeros(h, blocks * b - n, d, dtype=torch.float32)], dim=1)
        sizes = (torch.clamp(torch.arange(1, blocks + 1) * b, max=n) - torch.arange(blocks) * b).to(k.device)
        kmean = padded.view(h, blocks, b, d).sum(2) / sizes[None, :, None]
        return {"kmean": kmean.to(k.dtype), "meta": torch.tensor([b], dtype=torch.int64)}


class MobaSelector(QuestSelector):
    """Top blocks by block-mean score, within the token budget (Quest's ranking and budget, MoBA's scores).

    ``blocks``: the ``MobaBlocks`` artifact (``"{layer}.kmean"``, ``"0.meta"``) on the decode device.
    """

    def __init__(self, blocks: dict[str, torch.Tensor]):
        super().__init__(blocks)

    def _bounds_t(self, layer: int, p0: int, p1: int) -> torch.Tensor:
        """``[Hkv, D, p1 - p0]``: the mean keys of blocks ``[p0, p1)``, transposed once per layer and range."""
        key = (layer, p0, p1)
        if key not in self._stacked:
            self._stacked[key] = self.bounds[f"{layer}.kmean"][:, p0:p1].transpose(1, 2).contiguous()
        return self._stacked[key]

    def upper_bounds(self, layer: int, q: torch.Tensor, scale: float, p0: int, p1: int) -> torch.Tensor:
        """Block scores ``[T, Hkv, G, p1 - p0]`` (float32): ``scale · q . mean(K_block)``, one matmul per KV head."""
        kb = self._bounds_t(layer, p0, p1)
        t, hkv, g, _ = q.shape
        s = torch.bmm(q.permute(1, 0, 2, 3).reshape(hkv, t * g, -1).to(kb.dtype), kb)  # [Hkv, T*G, U]
        return s.view(hkv, t, g, -1).permute(1, 0, 2, 3).float() * scale


class Moba(SparseMethod):
    """Sink/tail anchors + MoBA block selection over the mid region."""

    name = "moba"
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = (MobaBlocks,)

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A MoBA selector over the stored block means."""
        return MobaSelector(source.artifact(MobaBlocks.name))
