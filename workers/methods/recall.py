"""The recall tier: a compressed cache plus, per step, the evicted pages the step's query points at.

``kvzip+quest`` (and ``hybridkv+quest``) decode the base method's compact cache at ``ratio`` exactly, and
within a per-step read budget (``budget``: a fraction of the prefix's tokens per layer and KV head) fetch
the stored pages whose *evicted* tokens could score highest: Quest's upper bound ``q⁺ . kmax + q⁻ . kmin``
over min/max key bounds computed over each page's evicted tokens only (an artifact of the prefix,
``<method>.r<ratio>.v<n>``, built once beside the base's cache). A fetched page's kept tokens are masked,
so no KV pair is attended twice, and the two parts (kept cache, recalled tokens) are merged exactly by
their log-sum-exps: the result is softmax attention over the kept ∪ recalled tokens.

Reads (``methods/reads.py``): the kept tokens every step, the recalled pages whole every step, and once
per generation the evicted-page bounds and the kept tokens' positions (which tokens to mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from workers.attention import merge_attention
from workers.kernels.unit_topk import group_top_units
from workers.methods.base import ReadReport
from workers.methods.compressed import CompressedPrefixAttention, CompressionMethod
from workers.methods.hybridkv import HybridKV
from workers.methods.kvzip import KVzip
from workers.methods.layer_kv import LayerKV, page_tokens
from workers.methods.quest import QuestSelector
from workers.methods.source import PrefixSource
from workers.methods.sparse import DEFAULT_FRACTION, gathered_attention, offload_counters
from workers.pages import page_count
from workers.requests import DecodeConfig

if TYPE_CHECKING:
    from workers.model import LoadedModel


def kept_mask(cache: dict[str, torch.Tensor], layer: int, n_tokens: int) -> torch.Tensor:
    """``[Hkv, N]`` bool: the tokens a compact cache keeps in ``layer`` (from its positions and head counts)."""
    idx, counts = cache[f"{layer}.idx"].long(), cache[f"{layer}.counts"].long()
    heads = torch.repeat_interleave(torch.arange(counts.numel(), device=idx.device), counts)
    mask = torch.zeros(counts.numel(), n_tokens, dtype=torch.bool, device=idx.device)
    mask[heads, idx] = True
    return mask


def evicted_bounds(k: torch.Tensor, kept: torch.Tensor, page_size: int) -> dict[str, torch.Tensor]:
    """K ``[Hkv, N, D]`` and its kept mask ``[Hkv, N]`` -> per page the element-wise ``kmin``, ``kmax``
    ``[Hkv, pages, D]`` of the *evicted* keys (0 where a page evicts none) and ``evicted`` ``[Hkv, pages]``
    int32, how many tokens it evicts."""
    h, n, d = k.shape
    pages = page_count(n, page_size)
    pad = pages * page_size - n
    evict = torch.cat([~kept, kept.new_zeros(h, pad)], dim=1).view(h, pages, page_size, 1)
    kp = torch.cat([k, k.new_zeros(h, pad, d)], dim=1).view(h, pages, page_size, d)
    kmax = kp.masked_fill(~evict, -math.inf).amax(2)
    kmin = kp.masked_fill(~evict, math.inf).amin(2)
    some = evict.any(2)
    return {"kmin": torch.where(some, kmin, 0.0).to(k.dtype), "kmax": torch.where(some, kmax, 0.0).to(k.dtype),
            "evicted": evict.sum(2).squeeze(-1).to(torch.int32)}


class RecallTier(CompressionMethod):
    """A base compression method's cache, plus the evicted pages each step's query points at (Quest bounds
    over the evicted tokens), within ``budget`` of the prefix per step."""

    base_cls: ClassVar[type[CompressionMethod]]
    fetches_pages = True

    def __init__(self) -> None:
        self.base = self.base_cls()

    def base_method(self) -> CompressionMethod:
        """The cache this tier recalls around (shared with the base method at the same ratio)."""
        return self.base

    def keep(self, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        """The base method's keep set."""
        return self.base.keep(scores, ratio, n_layers, n_kv_heads, n_tokens)

    def derive(self, cache: dict[str, torch.Tensor], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
               page_size: int) -> dict[str, torch.Tensor]:
        """Bounds of every layer's evicted keys per store page (``QuestBounds``' keys plus ``evicted``)."""
        out = {"0.meta": torch.tensor([page_size], dtype=torch.int64)}
        for layer, (k, _) in enumerate(kv):
            for key, t in evicted_bounds(k, kept_mask(cache, layer, k.shape[1]).to(k.device), page_size).items():
                out[f"{layer}.{key}"] = t.cpu()
        return out

    def score(self, lm: LoadedModel, context_ids: Sequence[int],
              kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The base method's scores."""
        return self.base.score(lm, context_ids, kv)

    def open(self, source: PrefixSource, config: DecodeConfig) -> RecallPrefixAttention:
        """The base's cache at the request's ratio, this tier's bounds, and the per-step page budget."""
        cache = self.base.cache(source, config)
        kept = CompressedPrefixAttention(source, cache)
        before = source.bytes_read
        bounds = self.cache(source, config)
        kept.counter.add_once("summaries", source.bytes_read - before)
        fraction = config.budget if config.budget is not None else DEFAULT_FRACTION
        page = int(bounds["0.meta"][0])
        n_pages = min(page_count(source.n_tokens, page), int(fraction * source.n_tokens) // page)
        kept.counter.info.update({"budget_fraction": fraction, "recall_pages": float(n_pages)})
        return RecallPrefixAttention(source, kept, cache, bounds, n_pages)


class RecallPrefixAttention:
    """Kept-cache attention merged with attention over the recalled evicted tokens, per query token."""

    def __init__(self, source: PrefixSource, kept: CompressedPrefixAttention, cache: dict[str, torch.Tensor],
                 bounds: dict[str, torch.Tensor], n_pages: int):
        self.source, self.kept, self.n_pages = source, kept, n_pages
        self.counter = kept.counter
        self.quest = QuestSelector(bounds)
        self.page = self.quest.page
        n, lay = source.n_tokens, source.layout
        self.n_total_pages = page_count(n, self.page)
        self.masks = [kept_mask(cache, layer, n) for layer in range(lay.n_layers)]
        self.evicted = [bounds[f"{layer}.evicted"] > 0 for layer in range(lay.n_layers)]
        positions = sum(cache[f"{layer}.{x}"].numel() * 4 for layer in range(lay.n_layers) for x in ("idx", "counts"))
        self.counter.add_once("kept_positions", positions)
        self.layers: list[LayerKV] = [source.layer(layer) for layer in range(lay.n_layers)] if n_pages else []
        self._step = -1

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` -> (out, lse) over the kept tokens and the step's recalled evicted tokens."""
        if layer == 0:
            self._step += 1
        out, lse = self.kept.attend(layer, q, scale)  # counts the kept tokens (and starts the step)
        if not self.n_pages:
            return out, lse
        b, hq, n_q, d = q.shape
        rows = q.permute(0, 2, 1, 3).reshape(b * n_q, hq, d)
        o2, l2, pages = self._recall(layer, rows, scale)
        self.counter.add_layer(pages * self.page)
        o2 = o2.reshape(b, n_q, hq, d).permute(0, 2, 1, 3)
        return merge_attention(out, lse, o2, l2.reshape(b, n_q, hq).permute(0, 2, 1))

    def pick(self, layer: int, rows: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Query rows ``[T, Hq, D]`` -> the ``n_pages`` pages per (row, KV head) whose evicted keys' upper-bound
        mass is highest ``[T, Hkv, n]``, pages that evict something first, and which those are ``[T, Hkv, n]``."""
        t, hq, d = rows.shape
        evicted = self.evicted[layer]
        hkv = evicted.shape[0]
        ub = self.quest.upper_bounds(layer, rows.view(t, hkv, hq // hkv, d), scale, 0, self.n_total_pages)
        ub = ub.masked_fill(~evicted[None, :, None, :], -math.inf)  # a page evicting nothing has nothing to recall
        picked = group_top_units(ub.reshape(t * hkv, hq // hkv, -1), self.n_pages).view(t, hkv, -1)
        valid = evicted.unsqueeze(0).expand(t, -1, -1).gather(2, picked)
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
        return picked.gather(2, order), valid.gather(2, order)

    def _recall(self, layer: int, rows: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention of rows over their picked pages' evicted tokens, and the distinct pages fetched."""
        t, n = rows.shape[0], self.source.n_tokens
        picked, valid = self.pick(layer, rows, scale)
        tokens = page_tokens(picked * self.page, self.page)  # [T, Hkv, n * page]
        safe = tokens.clamp_max(n - 1)
        evicted = ~self.masks[layer].unsqueeze(0).expand(t, -1, -1).gather(2, safe)
        attend = valid.repeat_interleave(self.page, dim=-1) & (tokens < n) & evicted
        bias = torch.zeros(attend.shape, device=rows.device).masked_fill_(~attend, -math.inf)
        counts = valid.sum(-1) * self.page
        kv = self.layers[layer]
        kv.at_step = self._step
        step = kv.step(safe, counts, self._step, overflow=True)
        out, lse = gathered_attention(rows, step.k, step.v, scale=scale, idx=step.rows, n_valid=counts, bias=bias,
                                      pseudo_logits=None, pseudo_values=None)
        fetched = torch.zeros(picked.shape[1], self.n_total_pages, dtype=torch.bool, device=rows.device)
        heads = torch.arange(picked.shape[1], device=rows.device).view(1, -1, 1).expand_as(picked)
        fetched[heads[valid], picked[valid]] = True
        return out, lse, fetched.sum()

    def read_report(self) -> ReadReport:
        """Kept tokens and recalled whole pages per step; bounds and kept positions once."""
        report = self.counter.report()
        if (fetcher := self.source.fetcher) is not None and self.layers:
            steps = len(report.tokens_per_step)
            report.extra.update(offload_counters(fetcher, self.source.device_cache, steps))
            kept_bytes = sum(self.kept.kept) * self.counter.token_bytes * steps
            report.step_bytes = (kept_bytes + int(report.extra["offload_pages_requested"])
                                 * self.source.layout.page_payload_bytes)
        return report


class KVzipQuest(RecallTier):
    """KVzip's cache plus the recall tier."""

    name = "kvzip+quest"
    base_cls = KVzip


class HybridKVQuest(RecallTier):
    """HybridKV's cache plus the recall tier."""

    name = "hybridkv+quest"
    base_cls = HybridKV
