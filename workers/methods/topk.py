"""Exhaustive Top-K over the mid region: the accuracy reference (keys resident, every logit computed)."""

from __future__ import annotations

import torch

from workers.methods.phi import PhiSummarizer
from workers.methods.selector import LayerContext, Selection, Selector, group_mass, top_tokens
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.requests import DecodeConfig


class TopKSelector(Selector):
    """The ``k`` mid tokens with the most group attention mass, per query token and KV head."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Hold the layer's mid keys (read once)."""
        self._keys[layer] = ctx.kv.mid_keys(ctx.lo, ctx.hi)

    def resident_bytes(self, ctx: LayerContext) -> int:
        """The mid keys it scores exhaustively."""
        return ctx.kv.n_heads * ctx.n_mid * ctx.kv.head_dim * ctx.kv.dtype.itemsize

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Exact top-k of ``group_mass(scale q . K_mid)``; ``k=None`` takes every mid token."""
        t, hkv = q.shape[0], q.shape[1]
        logits = torch.einsum("thgd,hnd->thgn", q.float(), self._keys[layer].float()) * scale
        scores = group_mass(logits).reshape(t * hkv, ctx.n_mid)
        ids = top_tokens(scores, ctx.n_mid if k is None else k).reshape(t, hkv, -1) + ctx.lo
        return Selection(tokens=ids, counts=torch.full((t, hkv), ids.shape[-1], device=q.device))


class TopK(SparseMethod):
    """Sink/tail anchors + exhaustive Top-K over the mid region."""

    name = "topk"

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A Top-K selector (needs no summary)."""
        return TopKSelector()


class TopKPhi(TopK):
    """Sink/tail anchors + exhaustive Top-K over the mid region, plus φ completion of the unretrieved mid
    remainder."""

    name = "topk+phi"
    summarizers = (*TopK.summarizers, PhiSummarizer)
    completion = True
