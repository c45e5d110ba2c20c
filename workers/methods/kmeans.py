"""Batched Lloyd k-means over keys, one independent problem per KV head (seeded, GPU-friendly)."""

from __future__ import annotations

import torch

from workers.kernels.kmeans_assign import kmeans_assign


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


def kmeans(x: torch.Tensor, n_clusters: int, *, iters: int = 10, seed: int = 0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per head: x ``[H, n, D]`` float -> (centroids ``[H, C, D]``, labels ``[H, n]``).

    Initial centroids are ``C`` distinct points per row drawn, row after row, from a CPU generator (the
    same on every device): ``generator`` if given (it advances, so consecutive calls draw fresh inits),
    else one seeded with ``seed``. Each iteration assigns then recomputes means; a cluster that empties
    keeps its previous centroid (and has size 0). The returned centroids are the means of the returned labels.
    """
    h, n, _ = x.shape
    if not 1 <= n_clusters <= n:
        raise ValueError(f"n_clusters must be in [1, {n}], got {n_clusters}")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    init = torch.stack([torch.randperm(n, generator=g)[:n_clusters] for _ in range(h)]).to(x.device)
    centroids = x.gather(1, init[..., None].expand(-1, -1, x.shape[-1])).clone()
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
