"""Quest (Tang et al. 2024): per-page min/max key bounds; the pages with the highest upper-bound score.

For a page with element-wise key bounds ``[kmin, kmax]`` the largest logit any of its keys can
reach is ``Σ_d max(q_d kmin_d, q_d kmax_d) = q⁺ . kmax + q⁻ . kmin`` (``workers.kernels.quest_scores``). Pages are
ranked by the group's softmax over these bounds and taken best-first while their mid tokens fit
the budget.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import ClassVar

import torch

from workers.kernels.quest_scores import quest_upper_bounds
from workers.kernels.unit_topk import group_top_units, top_units
from workers.methods.base import Summarizer
from workers.methods.pages_together import PageBounds
from workers.methods.phi import PhiSummarizer
from workers.methods.selector import (
    LayerContext,
    Selection,
    Selector,
    choose_units,
    group_mass,
    mask_to_index,
)
from workers.methods.shared_state import shared_by_prefix
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.offload.streamed_summary import StreamedArtifact
from workers.pages import page_count, page_of, page_span
from workers.requests import DecodeConfig

QUEST_PAGE = 16


class QuestBounds(Summarizer):
    """Prefill: element-wise min and max of the keys of each ``page_size``-token page (artifact ``bounds``)."""

    name = "bounds"
    version = 1
    page_size = QUEST_PAGE

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K ``[Hkv, N, D]`` -> ``kmin``, ``kmax`` ``[Hkv, pages, D]`` (K's dtype) and ``meta = [page_size]``."""
        h, n, d = k.shape
        p = self.page_size
        pages = page_count(n, p)
        padded = torch.cat([k, k[:, -1:].expand(h, pages * p - n, d)], dim=1).view(h, pages, p, d)
        return {"kmin": padded.amin(2), "kmax": padded.amax(2), "meta": torch.tensor([p], dtype=torch.int64)}


class StackedBounds:
    """A prefix's page bounds stacked per layer for the scoring kernel: ``[Hkv, 2D, pages]``, kmax over kmin in the
    bounds' dtype, built once per layer (a step is then one batched matmul, with no per-step dtype conversion),
    a page range served as a view of it. A layer's kmax and kmin are dropped once it is stacked. Read-only once
    built, so the generations over one stored prefix share one (``shared_bounds``), whatever their page ranges."""

    def __init__(self, bounds: Mapping[str, torch.Tensor] | StreamedArtifact):
        self.page = int(bounds["0.meta"][0])
        metas = [n for n in bounds if n.endswith(".meta")]  # read above: held by neither kind of source
        if isinstance(bounds, StreamedArtifact):  # its own already; its later layers may still be on their way
            bounds.forget(metas)
            self.bounds: dict[str, torch.Tensor] | StreamedArtifact = bounds
        else:  # its own dict: ``get`` drops entries a caller's dict still holds
            self.bounds = {n: t for n, t in bounds.items() if n not in metas}
        self._stacked: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.shared_across_generations = False
        """Whether ``shared_bounds`` hands it out (its device bytes are then no one generation's own)."""

    def verify(self) -> None:
        """Raise CorruptData unless the bounds it was made from matched their digest (waits for a streamed read)."""
        if isinstance(self.bounds, StreamedArtifact):
            self.bounds.verify()

    def get(self, layer: int, p0: int, p1: int) -> torch.Tensor:
        """The stacked bounds of ``layer``'s pages ``[p0, p1)``: ``[Hkv, 2D, p1 - p0]``, pages contiguous (a view:
        ``quest_upper_bounds`` takes its row stride)."""
        with self._lock:
            full = self._stacked.get(layer)
            if full is None:
                kmax, kmin = self.bounds.pop(f"{layer}.kmax"), self.bounds.pop(f"{layer}.kmin")
                full = self._stacked[layer] = torch.cat([kmax, kmin], dim=-1).transpose(1, 2).contiguous()
        if not 0 <= p0 <= p1 <= full.shape[2]:
            raise ValueError(f"layer {layer}: pages [{p0}, {p1}) outside the prefix's {full.shape[2]} pages")
        return full[..., p0:p1]


def shared_bounds(source: PrefixSource) -> StackedBounds:
    """The stacked page bounds of ``source``'s prefix: those another generation over it holds (nothing is read
    then), else read now."""
    return shared_by_prefix(source, QuestBounds.name, StackedBounds, streamed=True)


class QuestSelector(Selector):
    """Top pages by upper-bound score, within the token budget.

    ``bounds``: the ``QuestBounds`` artifact (``"{layer}.kmin"``, ``"{layer}.kmax"``, ``"0.meta"``) on the
    decode device.
    """

    def __init__(self, bounds: dict[str, torch.Tensor] | StackedBounds):
        self.stacked = bounds if isinstance(bounds, StackedBounds) else StackedBounds(bounds)
        """The page bounds stacked for the scoring kernel (shared by the generations over one stored prefix)."""
        self.bounds = self.stacked.bounds
        self.page = self.page_size = self.stacked.page
        self._stacked: dict[tuple[int, int, int], torch.Tensor] = {}  # a subclass's own stacked summaries

    def verify_summaries(self) -> None:
        """The page bounds it scores against (streamed in while the query ran) must match their digest."""
        self.stacked.verify()

    def _bounds_t(self, layer: int, p0: int, p1: int) -> torch.Tensor:
        """``[Hkv, 2D, p1 - p0]``: kmax over kmin of pages ``[p0, p1)`` (``StackedBounds.get``)."""
        return self.stacked.get(layer, p0, p1)

    def upper_bounds(self, layer: int, q: torch.Tensor, scale: float, p0: int, p1: int) -> torch.Tensor:
        """Upper-bound logits ``[T, Hkv, G, p1 - p0]`` (float32) of pages ``[p0, p1)``:
        ``[q⁺, q⁻] . [kmax; kmin]``, one kernel launch on CUDA (the bounds are read once)."""
        return quest_upper_bounds(q, self._bounds_t(layer, p0, p1), scale)

    def select_pages(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int) -> torch.Tensor:
        """The ``n`` pages overlapping ``[ctx.lo, ctx.hi)`` with the most upper-bound mass."""
        p0, p1 = page_span(ctx.lo, ctx.hi, self.page)
        ub = self.upper_bounds(layer, q, scale, p0, p1)
        t, hkv, g, u = ub.shape
        return group_top_units(ub.reshape(t * hkv, g, u), n).view(t, hkv, -1) + p0

    def select_pages_shared(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int
                            ) -> torch.Tensor:
        """One set of ``n`` pages for every query row (``Selector.select_pages_shared``) by upper-bound mass."""
        p0, p1 = page_span(ctx.lo, ctx.hi, self.page)
        mass = group_mass(self.upper_bounds(layer, q, scale, p0, p1)).amax(0)  # [Hkv, pages]
        return top_units(mass, n) + p0

    def page_bounds(self, layer: int, ctx: LayerContext) -> PageBounds | None:
        """The stacked bounds ``select_pages`` scores (None for a subclass scoring pages another way: MoBA)."""
        if type(self).upper_bounds is not QuestSelector.upper_bounds:
            return None
        p0, p1 = page_span(ctx.lo, ctx.hi, self.page)
        return PageBounds(bounds=self._bounds_t(layer, p0, p1), p0=p0)

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Pages overlapping the mid region, ranked by upper-bound mass; their mid tokens are attended."""
        t, hkv = q.shape[0], q.shape[1]
        p = self.page
        p0, p1 = page_span(ctx.lo, ctx.hi, p)
        ub = self.upper_bounds(layer, q, scale, p0, p1)
        starts = torch.arange(p0, p1, device=q.device) * p
        sizes = (torch.clamp(starts + p, max=ctx.hi) - torch.clamp(starts, min=ctx.lo)).clamp_min(0)
        ranked = choose_units(group_mass(ub).reshape(t * hkv, -1), sizes=sizes,
                              budget=ctx.n_mid if k is None else k)
        mid_page = page_of(torch.arange(ctx.lo, ctx.hi, device=q.device), p) - p0
        token_mask = ranked.mask()[:, mid_page]
        ids, counts = mask_to_index(token_mask, offset=ctx.lo)
        return Selection(tokens=ids.reshape(t, hkv, -1), counts=counts.reshape(t, hkv))


class Quest(SparseMethod):
    """Sink/tail anchors + Quest page selection over the mid region."""

    name = "quest"
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = (QuestBounds,)

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A Quest selector over the stored page bounds."""
        return QuestSelector(shared_bounds(source))


class QuestPhi(Quest):
    """Sink/tail anchors + Quest page selection over the mid region, plus φ completion of the unretrieved
    mid remainder."""

    name = "quest+phi"
    summarizers = (*Quest.summarizers, PhiSummarizer)
    completion = True
