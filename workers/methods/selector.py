"""The decode-time selector interface, and top-k / top-p over scored units done once for all.

A selector picks, per (query token, KV head) row, which mid-region tokens a step attends exactly
(and, for Double-P, which clusters it approximates by their centroids). A *unit* is what a
selector ranks: one token (exhaustive Top-K), one page (Quest) or one cluster (Double-P).
``group_mass`` turns per-query-head logits into one score per KV head (GQA: the group's attention
distributions, averaged) and ``choose_units`` picks the prefix of the ranking that fits a token
budget and/or reaches a mass.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

import torch

from workers.methods.layer_kv import LayerKV
from workers.methods.pages_together import PageBounds


@dataclass(frozen=True, eq=False)
class LayerContext:
    """One layer's prefix K/V access and the mid region ``[lo, hi)`` selection works on."""

    kv: LayerKV
    """Resident or fetched-per-step K/V ``[Hkv, N, D]``."""
    lo: int
    hi: int

    @property
    def n_tokens(self) -> int:
        """Tokens in the prefix."""
        return self.kv.n_tokens

    @property
    def device(self) -> torch.device:
        """Where selection and attention run."""
        return self.kv.device

    @property
    def n_mid(self) -> int:
        """Tokens in the mid region."""
        return self.hi - self.lo

    @functools.cached_property
    def anchors(self) -> torch.Tensor:
        """Token ids outside the mid region (sink + tail), always attended exactly."""
        return torch.cat([torch.arange(0, self.lo), torch.arange(self.hi, self.n_tokens)]).to(self.device)


@dataclass(frozen=True)
class Selection:
    """What one layer attends per row ``(query token t, KV head h)``, valid entries first."""

    tokens: torch.Tensor
    """``[T, Hkv, n]`` absolute ids of mid tokens attended exactly."""
    counts: torch.Tensor
    """``[T, Hkv]`` how many of ``tokens`` are valid."""
    centroids: torch.Tensor | None = None
    """``[T, Hkv, m]`` ids of clusters attended through their centroid (Double-P), or None."""
    n_centroids: torch.Tensor | None = None
    """``[T, Hkv]`` how many of ``centroids`` are valid."""
    n_distinct: torch.Tensor | None = None
    """Distinct mid tokens of all rows and heads, where ``tokens`` repeats some (None: each row's valid
    ``tokens`` are distinct, so a single row reads ``counts.sum()``)."""
    scored: torch.Tensor | None = None
    """``[T, Hkv, s]`` distinct ids of mid tokens whose exact keys selection read (a superset of each row's
    ``tokens``: ``topk-token``'s shortlist), or None where selection reads no prefix K/V per step."""
    index_bytes: torch.Tensor | int = 0
    """Bytes of summaries this selection read besides the tokens' K/V (Double-P: every centroid for stage 1,
    the exact clusters' token ids, the approximated clusters' centroid K/V rows), summed over rows."""


@dataclass(frozen=True)
class ExtraEntries:
    """Extra rows appended to a layer's K/V buffer (Double-P centroids), each with a log-weight."""

    k: torch.Tensor
    """``[Hkv, M, D]`` keys (centroids)."""
    v: torch.Tensor
    """``[Hkv, M, D]`` values (cluster mean values)."""
    bias: torch.Tensor
    """``[Hkv, M]`` float32 additive log-weights (``log size``)."""


class Selector(abc.ABC):
    """Decode-time choice of exact tokens over the mid region (one instance per generation)."""

    def summary_range(self, layer: int) -> tuple[int, int] | None:
        """The token range this selector's summaries cover (None: any mid region)."""
        return None

    def prepare(self, layer: int, ctx: LayerContext) -> None:  # noqa: B027 - optional hook
        """Adapt this layer's summaries to ``ctx``'s mid region (once per layer, before ``select``)."""

    def extra_entries(self, layer: int) -> ExtraEntries | None:
        """Rows to append to the layer's K/V buffer (ids in ``Selection.centroids`` index them)."""
        return None

    def resident_bytes(self, ctx: LayerContext) -> int:
        """Prefix bytes the selector itself must hold for this layer (exhaustive Top-K: the keys)."""
        return 0

    def verify_summaries(self) -> None:  # noqa: B027 - optional hook
        """Raise CorruptData unless the summaries it selected with so far matched their digests (a selector whose
        summaries stream in waits here for the whole read)."""

    page_size: int | None = None
    """Set by selectors that can also pick whole pages of this size (``select_pages``)."""

    def select_pages(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int) -> torch.Tensor:
        """Grouped queries ``[T, Hkv, G, D]`` -> the ``n`` best whole pages per row ``[T, Hkv, n]`` overlapping
        the mid region (fixed shape, no device sync). Only where ``page_size`` is set."""
        raise NotImplementedError(f"{type(self).__name__} does not select whole pages")

    def select_pages_shared(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int
                            ) -> torch.Tensor | None:
        """Grouped queries ``[T, Hkv, G, D]`` -> one set of ``n`` whole pages for all ``T`` rows ``[Hkv, n]``: the
        pages whose largest share of any row's group mass is highest (None: this selector picks per row only)."""
        return None

    def page_bounds(self, layer: int, ctx: LayerContext) -> PageBounds | None:
        """The Quest page bounds ``select_pages`` scores for ``layer``, when it ranks pages by exactly those (then
        a captured step's like members score and rank together, ``workers.methods.pages_together``); else None."""
        return None

    @abc.abstractmethod
    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Grouped queries ``[T, Hkv, G, D]`` -> the tokens to attend; ``k`` caps exact mid tokens
        per row (None: the selector's adaptive rule)."""


def group_mass(logits: torch.Tensor) -> torch.Tensor:
    """Logits ``[..., Hkv, G, U]`` -> the group-mean softmax over units ``[..., Hkv, U]``.

    Each query head's distribution sums to one, so every head of the group gets an equal say
    regardless of its logit scale; ``-inf`` logits get mass 0.
    """
    return torch.softmax(logits.float(), dim=-1).nan_to_num_(0.0).mean(dim=-2)  # in place: one buffer less per step


@dataclass(frozen=True)
class Ranked:
    """Units sorted by descending score, and how many of the ranking each row takes."""

    order: torch.Tensor
    """``[R, U]`` unit ids, best first."""
    n_chosen: torch.Tensor
    """``[R]`` length of the chosen prefix of ``order``."""

    def mask(self, start: torch.Tensor | None = None) -> torch.Tensor:
        """``[R, U]`` bool: units ranked in ``[start, n_chosen)`` (start 0 by default)."""
        rank = torch.arange(self.order.shape[-1], device=self.order.device)
        hit = rank < self.n_chosen[:, None]
        if start is not None:
            hit &= rank >= start[:, None]
        return torch.zeros_like(hit).scatter_(1, self.order, hit)


def rank_units(scores: torch.Tensor) -> torch.Tensor:
    """``[R, U]`` -> unit ids sorted by descending score (ties: lower id first)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def choose_units(scores: torch.Tensor, *, sizes: torch.Tensor | None = None, budget: int | None = None,
                 p: float | None = None, order: torch.Tensor | None = None) -> Ranked:
    """Pick a prefix of the score ranking per row.

    Parameters
    ----------
    scores : [R, U] float
        Non-negative unit scores (estimated attention mass for top-p).
    sizes : [R, U] or [U] integer, optional
        Tokens per unit (default 1): the budget counts tokens.
    budget : int, optional
        Take the longest prefix whose total size is ``<= budget`` (top-k for unit sizes).
    p : float, optional
        Take the shortest prefix whose mass reaches ``p`` of the row's total (top-p).
    order : [R, U], optional
        A ranking already computed for these scores (skips the sort).

    With both ``budget`` and ``p`` the shorter prefix wins; with neither every unit is taken.
    """
    r, u = scores.shape
    order = rank_units(scores) if order is None else order
    n = torch.full((r,), u, dtype=torch.long, device=scores.device)
    if budget is not None:
        sz = torch.ones_like(order) if sizes is None else sizes.expand(r, u).gather(1, order)
        n = torch.minimum(n, (sz.cumsum(-1) <= budget).sum(-1))
    if p is not None:
        mass = scores.gather(1, order).double()
        cum = mass.cumsum(-1) / mass.sum(-1, keepdim=True).clamp_min(1e-300)
        n = torch.minimum(n, ((cum < p).sum(-1) + 1).clamp_max(u))
    return Ranked(order=order, n_chosen=n)


def top_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, U]`` -> ``[R, min(k, U)]`` ids of the ``k`` best units (exact top-k, no full sort)."""
    k = max(0, min(k, scores.shape[-1]))
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def mask_to_index(mask: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, n]`` bool -> (``[R, max count]`` ids + ``offset`` with the valid ones first, ``[R]`` counts)."""
    counts = mask.sum(-1)
    width = int(counts.max()) if mask.numel() else 0
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
    return order + offset, counts
