"""Double-P (``double-p-hierarchical-top-p.txt``): cluster top-p, then a second top-p for exact tokens.

Prefill clusters each (layer, KV head)'s mid-region keys with k-means and stores centroids
``C_i``, sizes ``s_i``, value sums, and the cluster-contiguous token order (so a cluster can be
one contiguous read once pages follow it). At decode:

1. stage 1: ``Â = softmax(q C^T scale + log s)`` (the group's mean); the smallest top set whose
   mass reaches ``p1`` is kept, the rest is dropped;
2. stage 2: the clusters ranked first until ``p2`` of the mass are attended token by token (their
   ids read from the cluster-ordered token list); the other stage-1 clusters enter the same
   softmax through their centroid (bias ``log s_i``, value ``V̄_i``), eq. 8-9.

The paper has no token budget (p1, p2 are its knobs, 0.95 / 0.7 for Llama-3.1-8B). A request's
budget acts through stage 2 only: the threshold shared by a step's KV heads is lowered from ``p2``
to the largest one whose exact tokens fit the budget (``shared_top_p``), so concentrated heads take
few tokens and diffuse ones more, and no budget is the limit of large ones: each row's exact set,
hence a peaked set's error, is monotone in the budget. Stage 1 and the centroid approximation are
the paper's at every budget. Every step scores all centroids: those bytes (with the exact clusters'
ids and the approximated clusters' K/V rows) are charged per step (``Selection.index_bytes``).

With φ completion (``doublep+phi``) the centroid approximations are replaced by the φ
remainder term over every mid token not attended exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from workers.kernels import doublep_select as dp_kernel
from workers.methods.base import Summarizer, mid_range
from workers.methods.kmeans import SeedGraphs, cluster_sums, kmeans
from workers.methods.phi import PhiSummarizer
from workers.methods.selector import (
    ExtraEntries,
    LayerContext,
    Ranked,
    Selection,
    Selector,
    group_mass,
    rank_units,
)
from workers.methods.source import PrefixSource
from workers.methods.sparse import SparseMethod
from workers.requests import DecodeConfig


class ClusterSummarizer(Summarizer):
    """Prefill: k-means over mid keys per KV head, segment by segment (artifact ``clusters``)."""

    name = "clusters"
    version = 3
    late = True
    cluster_size = 8
    """Mean tokens per cluster (``ceil(n_mid / cluster_size)`` clusters). At 16 a rare, sharply attended key
    (a variable-tracking needle) shares its cluster with haystack keys whose mean logit hides it; at 8 vt at
    4k and 2 % rose from 0.47 to 0.83 (docs/benchmarks/accuracy.md) for twice the centroid bytes."""
    segment_tokens = 16384
    """Most mid tokens clustered together. The mid region is cut from its start into segments of this many
    tokens plus a shorter last one (the remainder; fixed boundaries, and the full segments are rows of one
    batched call), each clustered on its own with ``ceil(len / cluster_size)`` clusters. An assignment then
    computes ``n_mid * segment_tokens / cluster_size`` distances per head, linear in the context, where the
    whole region took ``n_mid^2 / cluster_size`` (at 128k 8x more: about 350 ms per layer on an H100, as long
    as 2/3 of the layer's forward pass). At 16384 every context up to 16k is one segment, clustered exactly as
    before (the 4k-16k accuracy tables stand). A multiple of ``cluster_size``: the segments hold as many
    clusters as the whole region would."""
    iters = 10
    seed = 0
    init = "plus_plus"
    """k-means seeding (``kmeans``' ``init``; summary version 3). With uniformly drawn seeds a rare key (a
    variable-tracking statement's) lands in a haystack cluster unless a seed falls on it (1 in ``cluster_size``);
    k-means++ draws seeds in proportion to the squared distance to the nearest one, so rare keys far from a
    repetitive haystack get clusters of their own. vt at 4k and 2 %: 0.83 -> 0.96 (CPU, 20 samples, reads 0.32 ->
    0.29), no budget 0.94 -> 0.97 (lab/notes/doublep_vt.md)."""

    graphed_seeding = False
    """Replay k-means++ seeding's steps as CUDA graphs (``kmeans.SeedGraphs``: the same ids, one launch a call
    instead of ~14 a step; seeding is ~33 s of a 128k x 32-layer late build on an H200, launch-bound). Off until
    its CUDA tests (``tests/test_kmeans_seeding.py``) and ``bench/bench_kmeans_seeding.py`` have run on a GPU: it
    was written after this session's last device run."""

    def __init__(self) -> None:
        self.seed_graphs: SeedGraphs | None = None
        """This instance's (one build's) k-means++ seeding graphs on a CUDA device, made at the first layer."""

    def _graphs(self, x: torch.Tensor) -> SeedGraphs | None:
        if not self.graphed_seeding or not x.is_cuda or self.init != "plus_plus":
            return None
        if self.seed_graphs is None:
            self.seed_graphs = SeedGraphs()
        return self.seed_graphs

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K, V ``[Hkv, N, D]`` -> centroids, sizes, vsum, perm (token ids in cluster order), offsets, meta."""
        d = DecodeConfig()
        lo, hi = mid_range(k.shape[1], d.sink, d.tail)
        h = k.shape[0]
        cent, labels = self.cluster(k[:, lo:hi].float(), layer)
        c = cent.shape[1]
        sizes, vsum = cluster_sums(v[:, lo:hi].float(), labels, c)
        perm = torch.sort(labels, dim=1, stable=True).indices + lo
        offsets = torch.cat([sizes.new_zeros(h, 1), sizes.cumsum(1)], dim=1)
        return {"centroids": cent, "sizes": sizes.int(), "vsum": vsum, "perm": perm.int(), "offsets": offsets.int(),
                "meta": torch.tensor([lo, hi, c], dtype=torch.int64)}

    def cluster(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mid keys ``x [H, n, D]`` float32 -> (centroids ``[H, C, D]``, labels ``[H, n]``), clustered per segment;
        segment ``s``'s cluster ids follow segment ``s - 1``'s."""
        h, n, dim = x.shape
        full, rest = divmod(n, self.segment_tokens)
        # One generator per layer: every (head, segment) row draws its own initial centroids from it, in order
        # (the full segments' rows, then the remainder's), so one segment is the unsegmented call bit for bit.
        gen = torch.Generator().manual_seed(self.seed + layer)
        cents: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        first = 0  # global id of the next segment's first cluster
        if full:  # the equal segments as extra rows of one batched call
            seg = self.segment_tokens
            c_seg = math.ceil(seg / self.cluster_size)
            cent, lab = kmeans(x[:, :full * seg].reshape(h * full, seg, dim), c_seg, iters=self.iters, generator=gen,
                               init=self.init, graphs=self._graphs(x))
            shift = torch.arange(full, device=x.device)[:, None] * c_seg
            cents.append(cent.reshape(h, full * c_seg, dim))
            labels.append((lab.view(h, full, seg) + shift).reshape(h, full * seg))
            first = full * c_seg
        if rest:
            # contiguous once here, not per iteration in ``cluster_sums``' reshape
            last = x[:, n - rest:].contiguous()
            cent, lab = kmeans(last, math.ceil(rest / self.cluster_size), iters=self.iters, generator=gen,
                               init=self.init, graphs=self._graphs(x))
            cents.append(cent)
            labels.append(lab + first)
        if not cents:  # no mid region
            return x.new_zeros(h, 0, dim), x.new_zeros(h, 0, dtype=torch.long)
        return torch.cat(cents, dim=1), torch.cat(labels, dim=1)


@dataclass(frozen=True)
class _Clusters:
    centroids: torch.Tensor  # [Hkv, C, D] float32
    log_sizes: torch.Tensor  # [Hkv, C] float32, log s_i after removing this request's extra anchors (-inf: empty)
    sizes: torch.Tensor  # [Hkv, C] long
    vbar: torch.Tensor  # [Hkv, C, D] float32
    perm: torch.Tensor  # [Hkv, n_mid] mid token ids in cluster order (this request's mid region only)
    offsets: torch.Tensor  # [Hkv, C + 1] long, cluster c is perm[offsets[c]:offsets[c + 1]]
    # Per-generation constants of the step (made once in ``prepare``, not per step):
    starts: torch.Tensor  # [Hkv, C] long, cluster c of head h is perm.view(-1)[starts[h, c]:][:sizes[h, c]]
    nonempty: torch.Tensor  # [Hkv, C] bool, sizes > 0
    centroids_t: torch.Tensor  # [Hkv, D, C] centroids.transpose(1, 2) (a view)
    log_sizes_g: torch.Tensor  # [Hkv, 1, C] log_sizes[:, None] (a view)


def shared_top_p(m: torch.Tensor, csum: torch.Tensor, total: torch.Tensor, ranked_sizes: torch.Tensor,
                 limit: torch.Tensor, budget: int, groups: int) -> torch.Tensor:
    """Stage 2 under a token budget: one top-p threshold shared by the rows of each group.

    ``m [R, U]``: each row's masses in rank order (float64; rows: ``groups`` blocks of KV heads), ``csum`` their
    prefix sums, ``total [R, 1]`` the rows' totals, ``ranked_sizes`` the units' sizes in rank order, ``limit [R]``
    the top-``p2`` prefix lengths. A row's top-p prefix at threshold ``p`` holds the units whose mass ranked before
    them is below ``p``; this raises ``p`` (at most to ``p2``: ``limit``) while the group's exact tokens fit
    ``budget``, so heads whose mass is concentrated take few tokens and diffuse heads more. Returns each row's
    prefix length ``[R]``; a larger budget never shortens one, and no budget at all gives ``limit``. Only the
    first ``max(limit)`` ranks can be taken, so only they are sorted (a stable sort keeps the finite entries'
    order, so the answer is the whole rows')."""
    r = m.shape[0]
    w = int(limit.max()) if r else 0
    before = (csum[:, :w] - m[:, :w]) / total
    eligible = torch.arange(w, device=m.device) < limit[:, None]
    entry = torch.where(eligible, before, torch.inf).reshape(groups, -1)
    by_entry = torch.sort(entry, dim=-1, stable=True).indices  # stable: a row's units stay in rank order
    cost = ranked_sizes[:, :w].reshape(groups, -1).gather(1, by_entry).cumsum(-1)
    take = (cost <= budget) & entry.gather(1, by_entry).isfinite()
    return torch.zeros_like(take).scatter_(1, by_entry, take).reshape(r, w).sum(-1)


def _rank(mass: torch.Tensor) -> torch.Tensor:
    """``rank_units`` of masses ``[R, U]`` (non-negative: descending, ties lower id first). On the CPU one SIMD sort
    of unique int64 keys (a non-negative float32's bits order as it does; the unit id below them breaks ties as the
    stable sort does): the same ranking, several times faster than torch's stable sort at thousands of clusters."""
    if mass.device.type != "cpu" or mass.dtype != torch.float32:
        return rank_units(mass)
    key = mass.contiguous().numpy().view(np.int32).astype(np.int64)
    np.subtract(0x7FFFFFFF, key, out=key)
    key <<= 32
    key |= np.arange(mass.shape[-1], dtype=np.int64)
    key.sort(axis=-1)
    key &= 0xFFFFFFFF
    return torch.from_numpy(key)


def _sort_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.sort(x, dim=-1).values`` of a fresh int64 ``x`` (on the CPU sorted in place by numpy's SIMD sort)."""
    if x.device.type != "cpu":
        return torch.sort(x, dim=-1).values
    x.numpy().sort(axis=-1)
    return x


def _valid_first(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask_to_index``'s ids: ``[R, width]`` column ids of each row's set entries (ascending), then the rest."""
    if mask.device.type != "cpu":
        return torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
    return torch.from_numpy(np.argsort(~mask.numpy(), axis=-1, kind="stable")[:, :width])


def cluster_tokens(perm: torch.Tensor, ranked_sizes: torch.Tensor, starts: torch.Tensor, order: torch.Tensor,
                   n: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token ids of each row's first ``n [R]`` clusters of ``order [R, C]``, read from the cluster-ordered
    ``perm [Hkv, n_mid]`` (no per-token scan; ``ranked_sizes [R, C]``: the sizes in rank order, ``starts [R, C]``:
    each cluster's first position in ``perm.view(-1)``, by cluster id): (``[R, max count]`` ascending ids, padded with
    ``pad``; ``[R]`` counts; their sum)."""
    r = order.shape[0]
    w = int(n.max()) if r else 0
    dev = order.device
    lens = torch.where(torch.arange(w, device=dev) < n[:, None], ranked_sizes[:, :w], 0)  # [R, w]
    counts = lens.sum(-1)
    width, total = torch.stack([counts.max(), counts.sum()]).tolist() if r else (0, 0)
    lf = lens.reshape(-1)
    # Each cluster's tokens are a run of perm (source) and of its row of the padded output (dest).
    rel = (lf.cumsum(0) - lf).unsqueeze(-1)
    row_base = (torch.arange(r, device=dev) * width)[:, None] + lens.cumsum(-1) - lens
    base = torch.stack([starts.gather(1, order[:, :w]).reshape(-1), row_base.reshape(-1)], -1) - rel
    at = torch.repeat_interleave(base, lf, dim=0, output_size=total) + torch.arange(total, device=dev)[:, None]
    big = torch.iinfo(torch.long).max
    out = torch.full((r * width,), big, dtype=torch.long, device=dev)
    out[at[:, 1]] = perm.view(-1)[at[:, 0]].long()
    out = _sort_rows(out.view(r, width))
    return torch.where(out == big, pad, out), counts, total


HOST_BOOKKEEPING = True
"""On the CPU, the integer bookkeeping after the ranking (top-p prefix lengths, the budgeted stage 2, the exact
clusters' token ids, the approximated clusters) runs in numpy: the same arithmetic (elementwise IEEE float64, stable
sorts, integer sums; the masses' totals stay torch's sum), at about a third of torch's per-op cost on these small
arrays. False: the torch ops on every device (the tests compare both with the earlier selection)."""
CPU_KERNEL = True
"""On the CPU, with ``HOST_BOOKKEEPING``: the ranking and that bookkeeping in one C++ kernel
(``workers/kernels/doublep_select``; the same bits, a few microseconds instead of some forty numpy ops a layer),
where it builds; else the numpy form."""


def _shared_top_p_host(m: np.ndarray, csum: np.ndarray, total: np.ndarray, ranked_sizes: np.ndarray,
                       limit: np.ndarray, budget: int, groups: int) -> np.ndarray:
    """``shared_top_p`` in numpy."""
    r = m.shape[0]
    w = int(limit.max()) if r else 0
    before = (csum[:, :w] - m[:, :w]) / total
    entry = np.where(np.arange(w) < limit[:, None], before, np.inf).reshape(groups, -1)
    by_entry = np.argsort(entry, axis=-1, kind="stable")
    g = np.arange(groups)[:, None]  # row indices: plain fancy indexing (take_along_axis builds them in Python)
    cost = ranked_sizes[:, :w].reshape(groups, -1)[g, by_entry].cumsum(-1)
    take = (cost <= budget) & (entry[g, by_entry] < np.inf)
    out = np.zeros(take.shape, dtype=bool)
    out[g, by_entry] = take
    return out.reshape(r, w).sum(-1)


def _cluster_tokens_host(perm: np.ndarray, ranked_sizes: np.ndarray, starts: np.ndarray, order: np.ndarray,
                         n: np.ndarray, pad: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``cluster_tokens`` in numpy (``perm`` flattened)."""
    r = order.shape[0]
    w = int(n.max()) if r else 0
    lens = np.where(np.arange(w) < n[:, None], ranked_sizes[:, :w], 0)
    counts = lens.sum(-1)
    width, total = (int(counts.max()), int(counts.sum())) if r else (0, 0)
    lf = lens.reshape(-1)
    rel = np.cumsum(lf) - lf
    src = starts[np.arange(r)[:, None], order[:, :w]].reshape(-1) - rel
    dst = ((np.arange(r) * width)[:, None] + np.cumsum(lens, -1) - lens).reshape(-1) - rel
    step = np.arange(total)
    big = np.iinfo(np.int64).max
    out = np.full(r * width, big, dtype=np.int64)
    out[np.repeat(dst, lf) + step] = perm[np.repeat(src, lf) + step]
    out = out.reshape(r, width)
    out.sort(axis=-1)
    out[out == big] = pad
    return out, counts, total


class DoublePSelector(Selector):
    """Double-P's two top-p stages over clusters; optionally centroid pseudo-entries for the approximated ones."""

    def __init__(self, source: PrefixSource, *, p1: float, p2: float, centroid_fallback: bool):
        self.art = source.artifact(ClusterSummarizer.name)
        self.p1, self.p2, self.centroid_fallback = p1, p2, centroid_fallback
        self._layers: dict[int, _Clusters] = {}
        self._kernels: dict[int, dp_kernel.DoublePKernel] = {}
        """Layer -> the CPU kernel over its clusters (made on the layer's first kernel step)."""

    def summary_range(self, layer: int) -> tuple[int, int]:
        """Tokens the clusters cover."""
        meta = self.art[f"{layer}.meta"]
        return int(meta[0]), int(meta[1])

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Clusters restricted to ``ctx``'s mid region: they lose the tokens this request attends as anchors."""
        a = {key: self.art[f"{layer}.{key}"] for key in ("centroids", "sizes", "vsum", "perm", "offsets")}
        lo0, hi0 = self.summary_range(layer)
        h, c = a["sizes"].shape
        perm = a["perm"].long()
        sizes, vsum = a["sizes"].long(), a["vsum"].float()
        extra = torch.cat([torch.arange(lo0, ctx.lo), torch.arange(ctx.hi, hi0)]).to(ctx.device)
        if extra.numel() and c:
            pos = torch.arange(hi0 - lo0, device=ctx.device).expand(h, -1).contiguous()
            pos_label = torch.searchsorted(a["offsets"][:, 1:].long().contiguous(), pos, right=True)
            labels = torch.full((h, ctx.n_tokens), -1, dtype=torch.long, device=ctx.device)
            labels.scatter_(1, perm, pos_label)
            ds, dv = cluster_sums(ctx.kv.tokens(extra)[1].float(), labels[:, extra], c)
            sizes, vsum = sizes - ds, vsum - dv
            perm = perm[(perm >= ctx.lo) & (perm < ctx.hi)].view(h, ctx.n_mid)  # same tokens leave every head
        offsets = torch.cat([sizes.new_zeros(h, 1), sizes.cumsum(1)], dim=1)
        vbar = vsum / sizes.clamp_min(1).unsqueeze(-1)
        n_mid = perm.shape[1]
        starts = offsets[:, :-1] + torch.arange(h, device=offsets.device)[:, None] * n_mid
        self._kernels.pop(layer, None)
        cent, log_sizes = a["centroids"].float(), sizes.float().log()
        self._layers[layer] = _Clusters(cent, log_sizes, sizes, vbar, perm.to(torch.int32).contiguous(), offsets,
                                        starts=starts, nonempty=sizes > 0, centroids_t=cent.transpose(1, 2),
                                        log_sizes_g=log_sizes[:, None])

    def extra_entries(self, layer: int) -> ExtraEntries | None:
        """Centroids with bias ``log s`` and value ``V̄`` (only without φ completion)."""
        if not self.centroid_fallback:
            return None
        cl = self._layers[layer]
        return ExtraEntries(k=cl.centroids, v=cl.vbar, bias=cl.log_sizes)

    def select(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: int | None) -> Selection:
        """Stage 1 (top-``p1`` of the size-weighted centroid mass) and stage 2 (top-``p2`` of it exact; under a
        token budget ``k`` per row, the threshold is lowered from ``p2`` to the largest one whose exact tokens
        fit ``k`` per KV head on average)."""
        cl = self._layers[layer]
        t, hkv = q.shape[0], q.shape[1]
        r = t * hkv
        n_clusters = cl.centroids.shape[1]
        # the bmm the einsum "thgd,hcd->thgc" makes, without its planning; scaled and biased in place
        g, d = q.shape[2], q.shape[3]
        qf = q if q.dtype == torch.float32 else q.float()
        logits = torch.bmm(qf.transpose(0, 1).reshape(hkv, t * g, d), cl.centroids_t)
        logits = logits.view(hkv, t, g, n_clusters).transpose(0, 1).mul_(scale).add_(cl.log_sizes_g)
        mass = group_mass(logits).reshape(r, -1)
        # A budget that covers the mid region reads it all exactly, as for every method (the paper's
        # thresholds only decide what to leave out; here nothing has to be).
        covered = k is not None and k >= ctx.n_mid
        if (CPU_KERNEL and HOST_BOOKKEEPING and q.device.type == "cpu" and mass.dtype == torch.float32
                and dp_kernel.cpu_kernel_available()):
            return self._select_kernel(layer, cl, ctx, t, mass, covered, None if k is None else k * hkv)
        order = _rank(mass)
        m = csum = total = None
        if not covered:  # choose_units(mass, p=p1) and (p=p2) on one ranking: its cumulative mass is made once
            m = mass.gather(1, order).double()
            csum = m.cumsum(-1)
            total = m.sum(-1, keepdim=True).clamp_min(1e-300)
        if HOST_BOOKKEEPING and q.device.type == "cpu":
            return self._select_host(cl, ctx, t, order, m, csum, total, None if k is None else k * hkv)
        # rows are (query token, KV head), heads fastest
        sizes, starts = (cl.sizes, cl.starts) if t == 1 else (cl.sizes.repeat(t, 1), cl.starts.repeat(t, 1))
        ranked_sizes = sizes.gather(1, order)
        if m is None or csum is None or total is None:
            stage1 = n_exact = torch.full((r,), n_clusters, dtype=torch.long, device=q.device)
        else:
            cum = csum / total
            stage1 = ((cum < self.p1).sum(-1) + 1).clamp_max(n_clusters)
            n_exact = torch.minimum(((cum < self.p2).sum(-1) + 1).clamp_max(n_clusters), stage1)
            if k is not None:
                n_exact = shared_top_p(m, csum, total, ranked_sizes, n_exact, budget=k * hkv, groups=t)
        ids, counts, n_ids = cluster_tokens(cl.perm, ranked_sizes, starts, order, n_exact, pad=ctx.lo)
        # Read per step: every centroid and its log-size (stage 1), the exact clusters' offsets and token ids.
        index_bytes = hkv * n_clusters * (cl.centroids.shape[-1] * cl.centroids.element_size() + 4) + (
            int(n_exact.sum()) * 2 * cl.offsets.element_size() + n_ids * cl.perm.element_size())
        sel = Selection(tokens=ids.reshape(t, hkv, -1), counts=counts.reshape(t, hkv), index_bytes=index_bytes)
        if not self.centroid_fallback:
            return sel
        nonempty = cl.nonempty if t == 1 else cl.nonempty.repeat(t, 1)
        approx = Ranked(order, stage1).mask(start=n_exact) & nonempty
        ccounts = approx.sum(-1)
        width, n_approx = torch.stack([ccounts.max(), ccounts.sum()]).tolist()
        cids = _valid_first(approx, width)
        # The approximated clusters enter the attention as one K and one V row each (model dtype).
        index_bytes = index_bytes + n_approx * 2 * cl.centroids.shape[-1] * ctx.kv.dtype.itemsize
        return Selection(tokens=sel.tokens, counts=sel.counts, centroids=cids.reshape(t, hkv, -1),
                         n_centroids=ccounts.reshape(t, hkv), index_bytes=index_bytes)

    def _select_kernel(self, layer: int, cl: _Clusters, ctx: LayerContext, t: int, mass: torch.Tensor,
                       covered: bool, budget: int | None) -> Selection:
        """``select`` after the stage-1 masses, in the CPU kernel (``workers/kernels/doublep_select``)."""
        hkv, n_clusters, d = cl.centroids.shape
        kernel = self._kernels.get(layer)
        if kernel is None:
            kernel = self._kernels[layer] = dp_kernel.DoublePKernel(cl.sizes, cl.starts, cl.nonempty, cl.perm.view(-1))
        pick = kernel.pick(mass, p1=self.p1, p2=self.p2, budget=budget, groups=t, pad=ctx.lo,
                           fallback=self.centroid_fallback, exact_all=covered)
        index_bytes = hkv * n_clusters * (d * cl.centroids.element_size() + 4) + (
            pick.n_exact * 2 * cl.offsets.element_size() + pick.n_ids * cl.perm.element_size())
        tokens, n_tok = pick.tokens.view(t, hkv, -1), pick.counts.view(t, hkv)
        if pick.centroids is None or pick.n_centroids is None:
            return Selection(tokens=tokens, counts=n_tok, index_bytes=index_bytes)
        index_bytes += pick.n_approx * 2 * d * ctx.kv.dtype.itemsize
        return Selection(tokens=tokens, counts=n_tok, centroids=pick.centroids.view(t, hkv, -1),
                         n_centroids=pick.n_centroids.view(t, hkv), index_bytes=index_bytes)

    def _select_host(self, cl: _Clusters, ctx: LayerContext, t: int, order: torch.Tensor, m: torch.Tensor | None,
                     csum: torch.Tensor | None, total: torch.Tensor | None, budget: int | None) -> Selection:
        """``select`` after the ranking, in numpy (CPU tensors; ``m`` None: every cluster exact)."""
        hkv, n_clusters, d = cl.centroids.shape
        o = order.numpy()
        sizes, starts, nonempty = cl.sizes.numpy(), cl.starts.numpy(), cl.nonempty.numpy()
        if t > 1:
            sizes, starts, nonempty = np.tile(sizes, (t, 1)), np.tile(starts, (t, 1)), np.tile(nonempty, (t, 1))
        rows = np.arange(o.shape[0])[:, None]
        ranked_sizes = sizes[rows, o]
        if m is None or csum is None or total is None:
            stage1 = n_exact = np.full(o.shape[0], n_clusters, dtype=np.int64)
        else:
            mn, cs, tot = m.numpy(), csum.numpy(), total.numpy()
            cum = cs / tot
            stage1 = np.minimum((cum < self.p1).sum(-1) + 1, n_clusters)
            n_exact = np.minimum(np.minimum((cum < self.p2).sum(-1) + 1, n_clusters), stage1)
            if budget is not None:
                n_exact = _shared_top_p_host(mn, cs, tot, ranked_sizes, n_exact, budget, t)
        ids, counts, n_ids = _cluster_tokens_host(cl.perm.view(-1).numpy(), ranked_sizes, starts, o, n_exact, ctx.lo)
        index_bytes = hkv * n_clusters * (d * cl.centroids.element_size() + 4) + (
            int(n_exact.sum()) * 2 * cl.offsets.element_size() + n_ids * cl.perm.element_size())
        tokens, n_tok = torch.from_numpy(ids).view(t, hkv, -1), torch.from_numpy(counts).view(t, hkv)
        if not self.centroid_fallback:
            return Selection(tokens=tokens, counts=n_tok, index_bytes=index_bytes)
        rank = np.arange(n_clusters)
        approx = np.zeros(o.shape, dtype=bool)
        approx[rows, o] = (rank >= n_exact[:, None]) & (rank < stage1[:, None])
        approx &= nonempty
        ccounts = approx.sum(-1)
        cids = np.argsort(~approx, axis=-1, kind="stable")[:, :int(ccounts.max())]  # mask_to_index
        index_bytes += int(ccounts.sum()) * 2 * d * ctx.kv.dtype.itemsize
        return Selection(tokens=tokens, counts=n_tok, centroids=torch.from_numpy(cids).view(t, hkv, -1),
                         n_centroids=torch.from_numpy(ccounts).view(t, hkv), index_bytes=index_bytes)


@dataclass(kw_only=True)
class DoubleP(SparseMethod):
    """Sink/tail anchors + Double-P hierarchical top-p (a budget caps the second top-p's exact tokens)."""

    name = "doublep"
    summarizers: ClassVar[tuple[type[Summarizer], ...]] = (ClusterSummarizer,)
    default_fraction = None
    p1: float = 0.95
    """Stage-1 mass: clusters beyond it are dropped."""
    p2: float = 0.7
    """Stage-2 mass: clusters attended token by token (a budget can only lower it)."""

    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """A Double-P selector over the stored clusters."""
        return DoublePSelector(source, p1=self.p1, p2=self.p2, centroid_fallback=not self.completion)


class DoublePPhi(DoubleP):
    """Sink/tail anchors + Double-P hierarchical top-p, plus φ completion of the unretrieved mid remainder
    (in place of the centroid approximations)."""

    name = "doublep+phi"
    summarizers = (*DoubleP.summarizers, PhiSummarizer)
    completion = True
