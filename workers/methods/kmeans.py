"""Batched Lloyd k-means over keys, one independent problem per KV head (seeded, GPU-friendly)."""

from __future__ import annotations

import logging

import torch

from workers.capture import graph_capture
from workers.kernels.kmeans_assign import kmeans_assign

log = logging.getLogger(__name__)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid (Euclidean) of each point: x ``[H, n, D]``, centroids ``[H, C, D]`` -> ``[H, n]``.

    The fused Triton kernel on CUDA (no ``[H, n, C]`` distance matrix), the torch reference elsewhere.
    """
    return kmeans_assign(x, centroids)


def cluster_sums(x: torch.Tensor, labels: torch.Tensor, n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster (sizes ``[H, C]``, sums ``[H, C, D]``) of points ``x [H, n, D]`` with ``labels [H, n]``."""
    h, n, d = x.shape
    flat = (labels + torch.arange(h, device=x.device)[:, None] * n_clusters).reshape(-1)
    sizes = torch.zeros(h * n_clusters, dtype=torch.long, device=x.device).index_add_(
        0, flat, torch.ones_like(flat))
    sums = torch.zeros(h * n_clusters, d, dtype=x.dtype, device=x.device).index_add_(0, flat, x.reshape(-1, d))
    return sizes.view(h, n_clusters), sums.view(h, n_clusters, d)


def plus_plus_init(x: torch.Tensor, n_clusters: int, g: torch.Generator,
                   graphs: SeedGraphs | None = None) -> torch.Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii, 2007) per row: x ``[H, n, D]`` -> point ids ``[H, C]``.

    The first seed is uniform, each next one drawn with probability proportional to its squared distance to the
    nearest seed so far (a point equal to a seed is never drawn again while others are farther). The draws'
    uniforms come from the CPU generator ``g`` in one call, so every device picks the same points up to rounding,
    and no step waits for the host. A row whose points all coincide with its seeds draws uniformly.

    One step per seed (``C`` sequential steps): the new seed's distances (one ``bmm``, the step's only pass over
    ``x`` and nearly all of its time on the CPU), a running minimum kept clamped and in float64 (the cumulative
    sum's dtype, exact: it holds float32 values), its cumulative sum and one ``searchsorted``. The same ids, bit
    for bit, as the step-per-op version it replaced (``tests/test_kmeans_seeding.py`` keeps it as the reference).
    With ``graphs`` on a CUDA device the steps replay as one CUDA graph per input shape (``SeedGraphs``)."""
    u = torch.rand(x.shape[0], n_clusters, generator=g, dtype=torch.float64).to(x.device)
    if graphs is not None and x.is_cuda:
        return graphs.seed(x, u, n_clusters)
    return _plus_plus_steps(x, u, n_clusters)


def _plus_plus_steps(x: torch.Tensor, u: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """``plus_plus_init``'s steps given the draws' uniforms ``u [H, C]`` float64 on ``x``'s device."""
    h, n, _ = x.shape
    dev = x.device
    # The draw of a row with nothing left to draw (all its points on seeds): uniform, floor(u * n), which is what
    # a search of u * n in 1..n gives.
    uniform = (u * n).long().clamp_max_(n - 1)
    ids = torch.empty(h, n_clusters, dtype=torch.long, device=dev)
    ids[:, :1] = uniform[:, :1]
    rows = torch.arange(h, device=dev)
    sq = (x * x).sum(-1)  # [H, n]
    best = torch.empty(h, n, dtype=torch.float64, device=dev)  # squared distance to the nearest seed, >= 0
    cum = torch.empty_like(best)
    dot = torch.empty(h, n, 1, dtype=x.dtype, device=dev)
    for j in range(n_clusters):
        if j:
            torch.cumsum(best, -1, out=cum)
            total = cum[:, -1:]
            pick = torch.searchsorted(cum, u[:, j:j + 1] * total, right=True).clamp_max_(n - 1)
            torch.where(total > 0, pick, uniform[:, j:j + 1], out=ids[:, j:j + 1])
        c = x[rows, ids[:, j]]  # [H, D]
        torch.bmm(x, c.unsqueeze(-1), out=dot)
        d = torch.sub(sq, dot.squeeze(-1), alpha=2).add_((c * c).sum(-1, keepdim=True)).clamp_min_(0)
        if j:
            torch.minimum(best, d, out=best)
        else:
            best.copy_(d)
    return ids


class SeedGraphs:
    """k-means++ seeding's steps captured as a CUDA graph per input shape and replayed: the same ids bit for bit as
    the eager steps (the same kernels on copies of the inputs), one graph launch where the eager steps make about
    14 small launches each, ``C`` steps a call (2,048 at 128k: launch-bound, about 1 s a layer on an H200). Meant
    for one build (a summarizer's layers share two shapes): the graphs, and a copy of each shape's keys, live as
    long as the object. A shape whose capture fails runs eagerly from then on."""

    def __init__(self, max_shapes: int = 4):
        self.max_shapes = max_shapes
        self._graphs: dict[tuple[object, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
                           | None] = {}
        self.captures = 0
        """Graphs captured (one per shape)."""
        self.replays = 0
        """Calls served by a graph."""

    def seed(self, x: torch.Tensor, u: torch.Tensor, n_clusters: int) -> torch.Tensor:
        """``_plus_plus_steps(x, u, n_clusters)``, by a graph replay when the shape's capture succeeded."""
        key = (tuple(x.shape), x.dtype, x.device, n_clusters)
        if key not in self._graphs:
            if len(self._graphs) >= self.max_shapes:
                self._graphs.pop(next(iter(self._graphs)))  # the oldest shape: its memory goes
            xs, us = x.clone(), u.clone()
            graph = torch.cuda.CUDAGraph()
            try:
                with graph_capture(graph, x.device):
                    ids = _plus_plus_steps(xs, us, n_clusters)
            except RuntimeError:
                log.warning("k-means++ seeding of shape %s could not be captured; it runs eagerly", key[:2],
                            exc_info=True)
                self._graphs[key] = None
            else:
                self._graphs[key] = (graph, xs, us, ids)
                self.captures += 1
        entry = self._graphs[key]
        if entry is None:
            return _plus_plus_steps(x, u, n_clusters)
        graph, xs, us, ids = entry
        xs.copy_(x)
        us.copy_(u)
        graph.replay()
        self.replays += 1
        return ids.clone()


SEED_ROUNDS = 16
"""``plus_plus_batched``: rounds of full-size batches after the doubling ramp (the cap on seeds per round is
``ceil((C - 1) / SEED_ROUNDS)``)."""


def batch_sizes(n_clusters: int, rounds: int = SEED_ROUNDS) -> list[int]:
    """Seeds drawn per round by ``plus_plus_batched`` after the first: 1, 2, 4, ... up to the cap
    ``ceil((C - 1) / rounds)``, then the cap, summing to ``C - 1`` (the last round takes what is left)."""
    cap = max(1, -(-(n_clusters - 1) // max(1, rounds)))
    sizes: list[int] = []
    left, b = n_clusters - 1, 1
    while left > 0:
        sizes.append(min(b, cap, left))
        left -= sizes[-1]
        b *= 2
    return sizes


def plus_plus_batched_init(x: torch.Tensor, n_clusters: int, g: torch.Generator,
                           rounds: int = SEED_ROUNDS) -> torch.Tensor:
    """k-means++ seeding in rounds of several draws: x ``[H, n, D]`` -> point ids ``[H, C]``.

    The first seed is uniform; each round then draws ``b`` seeds at once (``batch_sizes``: 1, 2, 4, ... up to
    ``ceil((C - 1) / rounds)``, so about ``rounds + log2(C / rounds)`` rounds instead of ``C - 1`` steps) from the
    k-means++ distribution of the round's start (squared distance to the nearest seed so far), by systematic
    sampling: the points whose cumulative weight crosses ``(i + u) / b`` of the total, ``i < b``, one uniform ``u``
    per round from the CPU generator ``g`` (the same points on every device up to rounding). As in k-means||
    (Bahmani et al., 2012) a round's draws do not see each other: a point holding more than ``1 / b`` of the
    remaining weight can be drawn twice in a round (a duplicate seed: its cluster stays empty), any other point at
    most once. A round's distances are one ``[n, D] x [D, b]`` product per row. With ``rounds >= C - 1`` (one seed
    per round) it is ``plus_plus_init`` bit for bit. A row whose points all coincide with its seeds draws
    systematically uniform ids.

    Not the default: Double-P on vt at 4k and 2 % (CPU, the shipped model, the eval's 20 samples) scored 0.87 with
    it against 0.96 with ``plus_plus`` (reads 0.298 / 0.293; 5 samples lower, 1 higher), about 15x less seeding
    time on the CPU and ~23 sequential rounds instead of ~2048 steps per call at 128k."""
    h, n, dim = x.shape
    dev = x.device
    sizes = batch_sizes(n_clusters, rounds)
    u = torch.rand(h, 1 + len(sizes), generator=g, dtype=torch.float64).to(dev)
    ids = torch.empty(h, n_clusters, dtype=torch.long, device=dev)
    ids[:, :1] = (u[:, :1] * n).long().clamp_max_(n - 1)
    sq = (x * x).sum(-1, keepdim=True)  # [H, n, 1]
    best = torch.empty(h, n, dtype=torch.float64, device=dev)  # squared distance to the nearest seed, >= 0
    cum = torch.empty_like(best)
    filled, b = 0, 1  # the seeds whose distances are in ``best``; the newest batch's size
    for r in range(len(sizes) + 1):
        new = ids[:, filled:filled + b]
        c = x.gather(1, new[..., None].expand(-1, -1, dim))  # [H, b, D]
        d = torch.sub(sq, torch.bmm(x, c.transpose(1, 2)), alpha=2).add_((c * c).sum(-1)[:, None])
        d = d.amin(-1).clamp_min_(0) if b > 1 else d.squeeze(-1).clamp_min_(0)
        if r:
            torch.minimum(best, d, out=best)
        else:
            best.copy_(d)
        filled += b
        if r == len(sizes):
            break
        b = sizes[r]
        torch.cumsum(best, -1, out=cum)
        total = cum[:, -1:]
        steps = (torch.arange(b, device=dev, dtype=torch.float64) + u[:, r + 1:r + 2]) / b  # [H, b] in [0, 1)
        pick = torch.searchsorted(cum, steps * total, right=True).clamp_max_(n - 1)
        torch.where(total > 0, pick, (steps * n).long().clamp_max_(n - 1), out=ids[:, filled:filled + b])
    return ids


INITS = ("random", "plus_plus", "plus_plus_batched")


def kmeans(x: torch.Tensor, n_clusters: int, *, iters: int = 10, seed: int = 0,
           generator: torch.Generator | None = None, init: str = "random",
           graphs: SeedGraphs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per head: x ``[H, n, D]`` float -> (centroids ``[H, C, D]``, labels ``[H, n]``).

    Initial centroids are ``C`` distinct points per row drawn, row after row, from a CPU generator (the
    same on every device): ``generator`` if given (it advances, so consecutive calls draw fresh inits),
    else one seeded with ``seed``; ``init="random"`` draws them uniformly, ``"plus_plus"`` by k-means++ seeding
    (``plus_plus_init``), ``"plus_plus_batched"`` by k-means++ in rounds of several draws
    (``plus_plus_batched_init``: about 20 sequential steps instead of ``C``; a point can be drawn twice in a
    round; ``graphs``: ``plus_plus``'s steps as CUDA graphs, ``SeedGraphs``). Each iteration assigns then
    recomputes means; a cluster that empties keeps its previous centroid (and has size 0). The returned centroids
    are the means of the returned labels.
    """
    h, n, _ = x.shape
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be in [1, {n}], got {n_clusters}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    if init == "plus_plus":
        first = plus_plus_init(x, n_clusters, g, graphs)
    elif init == "plus_plus_batched":
        first = plus_plus_batched_init(x, n_clusters, g)
    else:
        first = torch.stack([torch.randperm(n, generator=g)[:n_clusters] for _ in range(h)]).to(x.device)
    centroids = x.gather(1, first[..., None].expand(-1, -1, x.shape[-1])).clone()
    labels = assign(x, centroids)
    for _ in range(max(1, iters)):
        sizes, sums = cluster_sums(x, labels, n_clusters)
        centroids = torch.where(sizes[..., None] > 0, sums / sizes.clamp_min(1)[..., None].to(x.dtype), centroids)
        new = assign(x, centroids)
        if torch.equal(new, labels):
            break
        labels = new
    sizes, sums = cluster_sums(x, labels, n_clusters)
    centroids = torch.where(sizes[..., None] > 0, sums / sizes.clamp_min(1)[..., None].to(x.dtype), centroids)
    return centroids, labels
