"""Exhaustive Top-K over the mid region: the accuracy reference (keys resident, every logit computed)."""

from __future__ import annotations

import torch

from workers.methods.base import DecodeConfig, PrefixSource
from workers.methods.selector import LayerContext, Selection, Selector, group_mass, top_tokens
from workers.methods.sparse import SparseMethod


class TopKSelector(Selector):
    """The ``k`` mid tokens with the most group attention mass, per query token and KV head."""

    def resident_bytes(self, ctx: LayerContext) -> int:
        """The mid keys it scores exhaustively."""
        return ctx.k[:, ctx.lo:ctx.hi].numel() * ctx.k.element_size()

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Exact top-k of ``group_mass(scale q . K_mid)``; ``k=None`` takes every mid token."""
        t, hkv = q.shape[0], q.shape[1]
        logits = torch.einsum("thgd,hnd->thgn", q.float(), ctx.k[:, ctx.lo:ctx.hi].float()) * scale
        scores = group_mass(logits).reshape(t * hkv, ctx.n_mid)
        ids = top_tokens(scores, ctx.n_mid if k is None else k).reshape(t, hkv, -1) + ctx.lo
        return Selection(tokens=ids, counts=torch.full((t, hkv), ids.shape[-1], device=q.device))


class TopK(SparseMethod):
    """Sink/tail anchors + exhaustive Top-K over the mid region."""

    name = "topk"

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A Top-K selector (needs no summary)."""
        return TopKSelector()
