"""Top-K over the mid region: indexed (the product) and exhaustive (the accuracy oracle).

``topk`` scores every mid token on a resident low-bit key index (``key_index.py``, read once per
generation) and attends the whole pages of the store holding the most estimated mass (k / page_size
of them, ``select_pages``): a fetched step moves exactly those pages and the anchors', so the reads
a page fetcher makes match the budget instead of pulling a whole page per scattered token.
``topk-token`` picks single tokens: it keeps a shortlist of ``SHORTLIST`` x k tokens, reads only the
shortlist's exact keys to re-score it, and attends the K/V of the best k (resident, its reads are a
small multiple of the budget; fetched, each scattered token costs its whole page). ``topk-exact``
computes every mid logit from exact keys held for the generation: the reference selection, at the
cost of reading every mid key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from workers.kernels.index_page_mass import cpu_kernel_preferred, index_page_mass, page_mass_ref
from workers.kernels.unit_topk import top_units
from workers.methods.base import Summarizer
from workers.methods.key_index import (
    KeyIndexSummarizer,
    SharedKeyIndex,
    decoded_logits,
    index_logits,
    shared_key_index,
)
from workers.methods.phi import Completion, PhiCompletion, PhiSummarizer
from workers.methods.selector import LayerContext, Selection, Selector, group_mass, top_tokens
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.methods.value_index import IndexCompletion, IndexRemainder, Mass, ValueIndexSummarizer
from workers.requests import DecodeConfig

SHORTLIST = 2
"""Shortlist size as a multiple of k: tokens whose exact keys are re-scored per step."""


def _selection(ids: torch.Tensor, t: int, hkv: int, scored: torch.Tensor | None = None) -> Selection:
    return Selection(tokens=ids.reshape(t, hkv, -1), counts=torch.full((t, hkv), ids.shape[-1], device=ids.device),
                     scored=scored)


def _all_mid(ctx: LayerContext, t: int, hkv: int) -> Selection:
    ids = torch.arange(ctx.lo, ctx.hi, device=ctx.device).expand(t * hkv, -1)
    return _selection(ids, t, hkv)


class ExactTopKSelector(Selector):
    """The ``k`` mid tokens with the most group attention mass, per query token and KV head (exact keys)."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Hold the layer's mid keys (read once)."""
        self._keys[layer] = ctx.kv.mid_keys(ctx.lo, ctx.hi)

    def resident_bytes(self, ctx: LayerContext) -> int:
        """What reading the mid keys cost (the whole layer's K and V where it is fetched from the store)."""
        return ctx.kv.mid_keys_bytes(ctx.lo, ctx.hi)

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Exact top-k of ``group_mass(scale q . K_mid)``; ``k=None`` takes every mid token."""
        t, hkv = q.shape[0], q.shape[1]
        logits = torch.einsum("thgd,hnd->thgn", q.float(), self._keys[layer].float()) * scale
        scores = group_mass(logits).reshape(t * hkv, ctx.n_mid)
        return _selection(top_tokens(scores, ctx.n_mid if k is None else k) + ctx.lo, t, hkv)


class IndexedTopKSelector(Selector):
    """Top-k by group attention mass: a first pass on the key index, exact re-scoring of a shortlist.

    ``index``: the ``KeyIndexSummarizer`` artifact (``"{layer}.codes"``, ``.lo``, ``.step``, ``"0.meta"``)
    on the decode device. With ``page_size`` it also picks whole pages (``select_pages``): the pages
    holding the most of the index's estimated mass, so a fetched step moves only the budget's pages.
    """

    def __init__(self, index: dict[str, torch.Tensor] | SharedKeyIndex, shortlist: int = SHORTLIST,
                 page_size: int | None = None):
        if shortlist < 1:
            raise ValueError(f"shortlist must be >= 1, got {shortlist}")
        self.shared = index if isinstance(index, SharedKeyIndex) else SharedKeyIndex(index)
        """The index and its decoded keys (shared by the generations over one stored prefix)."""
        self.index, self.shortlist, self.page_size = self.shared.index, shortlist, page_size
        self.bits, self.block = (int(x) for x in self.index["0.meta"][:2])
        # On the CPU the per-step unpacking of the codes dominates scoring in torch: keys decoded once (bounded).
        self.decoded = self.shared.decoded
        # The page ranking on the CPU: the fused kernel on the codes (8x fewer bytes per step than decoded
        # float32 keys, no logits written), when it builds with AVX-512; else the torch path above (logged once).
        self.tiles = self.shared.tiles if self.shared.tiles is not None and cpu_kernel_preferred() else None

    def select_pages(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int) -> torch.Tensor:
        """The ``n`` pages overlapping the mid region whose mid tokens hold the most group mass on the index
        (each page's sum: the share of the estimated attention that attending it recovers)."""
        pages, p0 = self._page_mass(layer, ctx, q, scale)
        t, hkv = pages.shape[:2]
        return top_units(pages.reshape(t * hkv, -1), n).view(t, hkv, -1) + p0

    def select_pages_shared(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, n: int
                            ) -> torch.Tensor:
        """One set of ``n`` pages for every query row (``Selector.select_pages_shared``) by their mass on the
        index."""
        pages, p0 = self._page_mass(layer, ctx, q, scale)
        return top_units(pages.amax(0), n) + p0

    def _page_mass(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, int]:
        """Each row's group mass on the index summed per page overlapping the mid region ``[T, Hkv, pages]``, and
        the first page's id."""
        assert self.page_size is not None
        p = self.page_size
        p0 = ctx.lo // p
        if self.tiles is not None and ctx.hi > ctx.lo and q.device.type == "cpu":
            idx = self.index
            tiles = self.tiles.get(layer, idx[f"{layer}.codes"], idx[f"{layer}.lo"], idx[f"{layer}.step"], self.bits,
                                   self.block)
            if tiles is not None:
                return index_page_mass(q, tiles, scale, ctx.lo, ctx.hi, p), p0
        return page_mass_ref(self.approx_logits(layer, ctx, q, scale), ctx.lo, ctx.hi, p), p0

    def approx_logits(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Logits ``[T, Hkv, G, n_mid]`` (float32) of every mid token on the index."""
        codes, lo, step = self.index[f"{layer}.codes"], self.index[f"{layer}.lo"], self.index[f"{layer}.step"]
        keys = None if self.decoded is None else self.decoded.get(layer, codes, lo, step, self.bits, self.block)
        if keys is not None:
            return decoded_logits(q, keys, ctx.lo, ctx.hi).mul_(scale)
        return index_logits(q, codes, lo, step, self.bits, self.block, ctx.lo, ctx.hi).mul_(scale)

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """The shortlist's best ``k`` by exact group mass (normalized by the index's log-sum-exp over the whole
        mid region, so heads of a group weigh as in exact Top-K); ``k=None`` or a ``k`` covering the mid
        region takes every mid token, with no selection reads."""
        t, hkv = q.shape[0], q.shape[1]
        if k is None or k >= ctx.n_mid:
            return _all_mid(ctx, t, hkv)
        approx = self.approx_logits(layer, ctx, q, scale)
        lse = torch.logsumexp(approx, dim=-1, keepdim=True)  # [T, Hkv, G, 1]
        n_short = min(ctx.n_mid, self.shortlist * k)
        short = top_tokens(group_mass(approx).reshape(t * hkv, -1), n_short).reshape(t, hkv, n_short) + ctx.lo
        k_exact = ctx.kv.keys(short)  # [T, Hkv, S, D]: the only per-step key reads of selection
        exact = torch.einsum("thgd,thsd->thgs", q.float(), k_exact.float()) * scale
        mass = torch.exp(exact - lse).mean(dim=2).reshape(t * hkv, n_short)
        best = top_tokens(mass, k)
        return _selection(short.reshape(t * hkv, n_short).gather(1, best), t, hkv, scored=short)


class TopK(SparseMethod):
    """Sink/tail anchors + indexed Top-K over the mid region, in whole pages of the store."""

    name = "topk"
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = (KeyIndexSummarizer,)

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A page-granular Top-K selector over the stored key index."""
        return IndexedTopKSelector(shared_key_index(source), page_size=source.layout.page_size)


class TopKToken(TopK):
    """Sink/tail anchors + token-granular indexed Top-K (shortlist re-scored on exact keys)."""

    name = "topk-token"

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A token-granular Top-K selector over the stored key index."""
        return IndexedTopKSelector(shared_key_index(source))


@dataclass(kw_only=True)
class TopKPhi(TopK):
    """Sink/tail anchors + indexed Top-K over the mid region, plus φ completion of the unretrieved mid
    remainder (the paper's pseudo-entry: value ``N̂_R / Ẑ_R`` and logit ``log Ẑ_R`` from the φ cache).

    ``phi_value="index"`` takes the pseudo-entry's value from the key index's softmax over the unread tokens applied
    to their values in a 2-bit value index (``value_index.py``); ``phi_mass`` then picks its logit: φ's ``log Ẑ_R``
    (``"phi"``) or the key index's log-sum-exp over the unread tokens (``"index"``: no φ cache is fetched or
    charged, k is Top-K's). ``topk+vi`` is that last combination. Measured in
    ``lab/notes/phi_value_estimators.md``: on the shipped model φ's value is 45-62 % off and makes answers worse
    than Top-K's; the index remainder gives full attention's answers on the diagnosis samples (CPU, 8k).
    """

    name = "topk+phi"
    summarizers = (*TopK.summarizers, PhiSummarizer, ValueIndexSummarizer)
    completion = True
    phi_value: Literal["phi", "index"] = "phi"
    phi_mass: Mass = "index"

    def reads_summaries(self) -> tuple[type[Summarizer], ...]:
        """Top-K's, then the φ cache unless ``phi_mass="index"`` with the index's value, and the value index only
        with ``phi_value="index"``."""
        drop = {ValueIndexSummarizer} if self.phi_value == "phi" else (
            {PhiSummarizer} if self.phi_mass == "index" else set())
        return tuple(s for s in self.summarizers if s not in drop)

    def make_completion(self, source: PrefixSource, selector: Selector) -> Completion:
        """φ's term, or with ``phi_value="index"`` the index estimate of the remainder's value (and with
        ``phi_mass="index"`` its mass too, then without any φ cache) on this selector's key index."""
        if self.phi_value not in ("phi", "index"):
            raise ValueError(f"phi_value must be 'phi' or 'index', got {self.phi_value!r}")
        if self.phi_value == "phi":
            return super().make_completion(source, selector)
        assert isinstance(selector, IndexedTopKSelector)
        # the method's own value index (a subclass's summarizer may store another config under its own name)
        values = next(s for s in self.summarizers if issubclass(s, ValueIndexSummarizer))
        remainder = IndexRemainder(source, selector.approx_logits, self.phi_mass, artifact=values.name)
        if self.phi_mass == "index":
            return IndexCompletion(remainder)
        phi = PhiCompletion(source, self.feature_map)
        phi.remainder = remainder
        return phi


@dataclass(kw_only=True)
class TopKIndexRemainder(TopKPhi):
    """Indexed Top-K plus the remainder's pseudo-entry from the key index and a 2-bit value index (ours, issue 14):
    ``TopKPhi`` with ``phi_value="index"``, ``phi_mass="index"``. It reads no φ cache, but it reads the value
    index once per generation, about 8 % of the prefix's bf16 K/V at head_dim 64 (``VALUE_INDEX``)."""

    name = "topk+vi"
    summarizers = (*TopK.summarizers, ValueIndexSummarizer)
    phi_value: Literal["phi", "index"] = "index"
    phi_mass: Mass = "index"


class TopKExact(SparseMethod):
    """Sink/tail anchors + exhaustive Top-K over the mid region (exact keys of every mid token)."""

    name = "topk-exact"

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """An exhaustive Top-K selector (needs no summary)."""
        return ExactTopKSelector()


class TopKExactPhi(TopKExact):
    """Exhaustive Top-K plus φ completion of the unretrieved mid remainder."""

    name = "topk-exact+phi"
    summarizers = (*TopKExact.summarizers, PhiSummarizer)
    completion = True
