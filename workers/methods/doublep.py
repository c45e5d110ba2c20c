"""Double-P (``double-p-hierarchical-top-p.txt``): cluster top-p, then a second top-p for exact tokens.

Prefill clusters each (layer, KV head)'s mid-region keys with k-means and stores centroids
``C_i``, sizes ``s_i``, value sums, and the cluster-contiguous token order (so a cluster can be
one contiguous read once pages follow it). At decode:

1. stage 1: ``Â = softmax(q C^T scale + log s)`` (the group's mean); the smallest top set whose
   mass reaches ``p1`` is kept, the rest is dropped;
2. stage 2: the clusters ranked first until ``p2`` of the mass (or, under a token budget, while
   their tokens fit it) are attended token by token; the other stage-1 clusters enter the same
   softmax through their centroid (bias ``log s_i``, value ``V̄_i``).

With φ completion (``doublep+phi``) the centroid approximations are replaced by the φ
remainder term over every mid token not attended exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from workers.methods.base import Summarizer, mid_range
from workers.methods.kmeans import cluster_sums, kmeans
from workers.methods.phi import PhiSummarizer
from workers.methods.selector import (
    ExtraEntries,
    LayerContext,
    Ranked,
    Selection,
    Selector,
    choose_units,
    group_mass,
    mask_to_index,
    rank_units,
)
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.requests import DecodeConfig


class ClusterSummarizer(Summarizer):
    """Prefill: k-means over mid keys per KV head (artifact ``clusters``)."""

    name = "clusters"
    version = 1
    cluster_size = 16
    """Mean tokens per cluster (``ceil(n_mid / cluster_size)`` clusters)."""
    iters = 10
    seed = 0

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K, V ``[Hkv, N, D]`` -> centroids, sizes, vsum, perm (token ids in cluster order), offsets, meta."""
        d = DecodeConfig()
        lo, hi = mid_range(k.shape[1], d.sink, d.tail)
        h, n0, dim = k.shape[0], hi - lo, k.shape[-1]
        c = math.ceil(n0 / self.cluster_size)
        if c == 0:
            cent, labels = k.new_zeros(h, 0, dim, dtype=torch.float32), k.new_zeros(h, 0, dtype=torch.long)
        else:
            cent, labels = kmeans(k[:, lo:hi].float(), c, iters=self.iters, seed=self.seed + layer)
        sizes, vsum = cluster_sums(v[:, lo:hi].float(), labels, c)
        perm = torch.sort(labels, dim=1, stable=True).indices + lo
        offsets = torch.cat([sizes.new_zeros(h, 1), sizes.cumsum(1)], dim=1)
        return {"centroids": cent, "sizes": sizes.int(), "vsum": vsum, "perm": perm.int(), "offsets": offsets.int(),
                "meta": torch.tensor([lo, hi, c], dtype=torch.int64)}


@dataclass(frozen=True)
class _Clusters:
    centroids: torch.Tensor  # [Hkv, C, D] float32
    sizes: torch.Tensor  # [Hkv, C] long, after removing this request's extra anchors
    vbar: torch.Tensor  # [Hkv, C, D] float32
    labels: torch.Tensor  # [Hkv, n_mid] cluster of each mid token


class DoublePSelector(Selector):
    """Two-stage top-p over clusters; optionally centroid pseudo-entries for the approximated ones."""

    def __init__(self, source: PrefixSource, *, p1: float, p2: float, centroid_fallback: bool):
        self.art = source.artifact(ClusterSummarizer.name)
        self.p1, self.p2, self.centroid_fallback = p1, p2, centroid_fallback
        self._layers: dict[int, _Clusters] = {}

    def summary_range(self, layer: int) -> tuple[int, int]:
        """Tokens the clusters cover."""
        meta = self.art[f"{layer}.meta"]
        return int(meta[0]), int(meta[1])

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Token -> cluster labels; clusters lose the tokens this request attends as anchors."""
        a = {key: self.art[f"{layer}.{key}"] for key in ("centroids", "sizes", "vsum", "perm", "offsets")}
        lo0, hi0 = self.summary_range(layer)
        h, c = a["sizes"].shape
        pos = torch.arange(hi0 - lo0, device=ctx.device).expand(h, -1).contiguous()
        pos_label = torch.searchsorted(a["offsets"][:, 1:].long().contiguous(), pos, right=True)
        labels = torch.full((h, ctx.n_tokens), -1, dtype=torch.long, device=ctx.device)
        labels.scatter_(1, a["perm"].long(), pos_label)
        sizes, vsum = a["sizes"].long(), a["vsum"].float()
        extra = torch.cat([torch.arange(lo0, ctx.lo), torch.arange(ctx.hi, hi0)]).to(ctx.device)
        if extra.numel() and c:
            ds, dv = cluster_sums(ctx.kv.tokens(extra)[1].float(), labels[:, extra], c)
            sizes, vsum = sizes - ds, vsum - dv
        vbar = vsum / sizes.clamp_min(1).unsqueeze(-1)
        self._layers[layer] = _Clusters(a["centroids"].float(), sizes, vbar, labels[:, ctx.lo:ctx.hi])

    def extra_entries(self, layer: int) -> ExtraEntries | None:
        """Centroids with bias ``log s`` and value ``V̄`` (only without φ completion)."""
        if not self.centroid_fallback:
            return None
        cl = self._layers[layer]
        return ExtraEntries(k=cl.centroids, v=cl.vbar, bias=cl.sizes.float().log())

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Stage 1 (p1) and stage 2 (p2, or the token budget ``k``) over size-weighted centroid mass."""
        cl = self._layers[layer]
        t, hkv = q.shape[0], q.shape[1]
        logits = torch.einsum("thgd,hcd->thgc", q.float(), cl.centroids) * scale + cl.sizes.float().log()[:, None]
        mass = group_mass(logits).reshape(t * hkv, -1)
        order = rank_units(mass)
        sizes = cl.sizes.expand(t, -1, -1).reshape(t * hkv, -1)
        if k is None:
            exact = choose_units(mass, p=self.p2, order=order)
        else:
            exact = choose_units(mass, sizes=sizes, budget=k, order=order)
        labels = cl.labels.expand(t, -1, -1).reshape(t * hkv, -1)
        ids, counts = mask_to_index(exact.mask().gather(1, labels), offset=ctx.lo)
        sel = Selection(tokens=ids.reshape(t, hkv, -1), counts=counts.reshape(t, hkv))
        if not self.centroid_fallback:
            return sel
        stage1 = choose_units(mass, p=self.p1, order=order).n_chosen
        approx = Ranked(order, torch.maximum(stage1, exact.n_chosen)).mask(start=exact.n_chosen) & (sizes > 0)
        cids, ccounts = mask_to_index(approx)
        return Selection(tokens=sel.tokens, counts=sel.counts, centroids=cids.reshape(t, hkv, -1),
                         n_centroids=ccounts.reshape(t, hkv))


@dataclass(kw_only=True)
class DoubleP(SparseMethod):
    """Sink/tail anchors + Double-P hierarchical top-p (adaptive unless a budget is given)."""

    name = "doublep"
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = (ClusterSummarizer,)
    default_fraction = None
    p1: float = 0.95
    """Stage-1 mass: clusters beyond it are dropped."""
    p2: float = 0.7
    """Stage-2 mass: clusters attended token by token (without a budget)."""

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A Double-P selector over the stored clusters."""
        return DoublePSelector(source, p1=self.p1, p2=self.p2, centroid_fallback=not self.completion)


class DoublePPhi(DoubleP):
    """Sink/tail anchors + Double-P hierarchical top-p, plus φ completion of the unretrieved mid remainder
    (in place of the centroid approximations)."""

    name = "doublep+phi"
    summarizers = (*DoubleP.summarizers, PhiSummarizer)
    completion = True
