"""Members of a captured decode step that pick their pages together: one scoring and one top-k launch per layer.

In a whole-step CUDA graph (``workers.step_graph``) each generation's page selection is a chain of small
launches per layer (the Quest bounds scoring, the top-k's launches, the page list). At batch 8 those chains are
most of the step's graph nodes, and a captured step pays per node, not per byte. Members whose selections have
the same shape (equal prefix length, page range, page count and anchor pages: e.g. a batch of generations over
documents of one length, or over one document) are scored in one launch over a table of their bounds
(``quest_upper_bounds_members``) and ranked in one top-k over all their rows; each member then fetches and
attends its pages on its own. Every member's picked pages equal what its own selection would pick (the same
kernel arithmetic per row, and the top-k's rows are independent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from workers.kernels.quest_scores import member_offsets, quest_upper_bounds_members
from workers.kernels.unit_topk import group_top_units


@dataclass(frozen=True)
class PageBounds:
    """The page bounds a selector scores one layer's whole pages over (``Selector.page_bounds``)."""

    bounds: torch.Tensor
    """``[Hkv, 2D, U]`` Quest bounds (kmax rows over kmin rows) of pages ``[p0, p0 + U)``, pages contiguous."""
    p0: int
    """The first page scored."""


@dataclass(frozen=True)
class PageScoring:
    """What a member's whole-page selection of one layer needs to run with others' (``graph_page_scoring``)."""

    scored: PageBounds
    n_pages: int
    """Pages picked per KV head."""
    anchor_pages: torch.Tensor
    """``[Hkv, na]`` the pages fetched after the picked ones (anchor tokens' pages)."""

    def key(self) -> tuple[object, ...]:
        """Members with equal keys pick together (same shapes, strides, page range, count and anchor pages)."""
        b = self.scored.bounds
        anchors = tuple(self.anchor_pages.flatten().tolist())  # a few ids, read once when the step is made
        return (tuple(b.shape), b.stride(), b.dtype, b.device, self.scored.p0, self.n_pages,
                tuple(self.anchor_pages.shape), anchors)


@runtime_checkable
class PicksPagesTogether(Protocol):
    """A ``GraphablePrefix`` whose fixed-shape step can take pages picked together with other members'."""

    def graph_page_scoring(self, layer: int) -> PageScoring | None:
        """What its selection of ``layer`` scores (None: it picks alone)."""
        ...

    def graph_attend_pages(self, layer: int, q: torch.Tensor, scale: float, pages: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``graph_attend`` over given pages ``[Hkv, n + na]`` (picked, then anchor pages)."""
        ...


@dataclass(frozen=True)
class _Group:
    members: tuple[int, ...]
    """Positions in the step's member order, ascending."""
    bounds: tuple[torch.Tensor, ...]
    offsets: torch.Tensor
    """``member_offsets(bounds)``, made before any capture."""
    p0: int
    n_pages: int
    anchor_pages: torch.Tensor
    rows: torch.Tensor | None
    """``members`` as an index on the device when they are not one contiguous run (None when they are): a
    Python list index would copy from pageable host memory, which a CUDA graph capture refuses."""


class PagesTogether:
    """Per layer, the groups of a step's members that pick their pages together (made before the step is
    captured: it copies each group's bounds table to the device)."""

    MIN_GROUP = 2
    """Members a group needs (one member alone runs its own selection, as at batch 1)."""

    def __init__(self, scorings: list[Callable[[int], PageScoring | None] | None], n_layers: int):
        self._groups: list[list[_Group]] = []
        for layer in range(n_layers):
            by_key: dict[tuple[object, ...], list[tuple[int, PageScoring]]] = {}
            for i, scoring in enumerate(scorings):
                s = scoring(layer) if scoring is not None else None
                if s is not None:
                    by_key.setdefault(s.key(), []).append((i, s))
            groups = []
            for like in by_key.values():
                if len(like) < self.MIN_GROUP:
                    continue
                bounds = tuple(s.scored.bounds for _, s in like)
                first = like[0][1]
                members = tuple(i for i, _ in like)
                contiguous = members[-1] - members[0] + 1 == len(members)
                rows = None if contiguous else torch.tensor(members, device=first.anchor_pages.device)
                groups.append(_Group(members=members, bounds=bounds, offsets=member_offsets(bounds),
                                     p0=first.scored.p0, n_pages=first.n_pages, anchor_pages=first.anchor_pages,
                                     rows=rows))
            self._groups.append(groups)

    def members(self, layer: int) -> set[int]:
        """The members that pick together in ``layer``."""
        return {i for g in self._groups[layer] for i in g.members}

    def pick(self, layer: int, q: torch.Tensor, scale: float) -> dict[int, torch.Tensor]:
        """The step's packed queries ``[1, Hq, B, D]`` -> each grouped member's pages ``[Hkv, n + na]`` (picked,
        ascending, then its anchor pages), by its position in the step."""
        out: dict[int, torch.Tensor] = {}
        hq, d = q.shape[1], q.shape[3]
        for g in self._groups[layer]:
            m = len(g.members)
            first = g.members[0]
            rows = q[0, :, first:first + m] if g.rows is None else q[0].index_select(1, g.rows)  # [Hq, m, D]
            hkv = g.anchor_pages.shape[0]
            qg = rows.permute(1, 0, 2).reshape(m, hkv, hq // hkv, d)
            ub = quest_upper_bounds_members(qg, g.bounds, scale, offsets=g.offsets)  # [m, Hkv, G, U]
            # The default split top-k, also for a group's many rows: one program per row measured faster in
            # isolation (H200, 64 rows x 4,096 pages: 20.8 against 37 us) but slower in the engine's captured
            # step (48 against 34 us per layer, bench_engine batch 8 at 64k).
            picked = group_top_units(ub.reshape(m * hkv, hq // hkv, -1), g.n_pages).view(m, hkv, -1) + g.p0
            pages = torch.cat([picked, g.anchor_pages.expand(m, -1, -1)], dim=2)
            out.update(zip(g.members, pages.unbind(0), strict=True))
        return out
