"""Torch reference of the k-means assignment step (the CPU path, and the Triton kernel's oracle).

The ops ``workers.methods.kmeans.assign`` ran before the kernel: per chunk of points, the float32 distance
block ``||c||^2 - 2 x . c`` (``||x||^2`` is the same for every centroid of a point, so it is left out), then
``argmin`` (the first minimum: ties go to the lower centroid index). Operands are taken in float32 whatever
their dtype (exact for bf16/fp16), so bf16 inputs are not rounded to bf16 on the way.
"""

from __future__ import annotations

import torch

__all__ = ["ASSIGN_CHUNK", "kmeans_assign_ref"]

ASSIGN_CHUNK = 8192
"""Points per distance block (a ``[H, ASSIGN_CHUNK, C]`` float32 block is materialised at a time)."""


def kmeans_assign_ref(x: torch.Tensor, centroids: torch.Tensor, chunk: int = ASSIGN_CHUNK) -> torch.Tensor:
    """Nearest centroid (Euclidean) of each point: x ``[H, n, D]``, centroids ``[H, C, D]`` -> ``[H, n]`` int64."""
    x, centroids = x.float(), centroids.float()
    c2 = centroids.square().sum(-1)
    out = []
    for s in range(0, x.shape[1], chunk):
        xs = x[:, s:s + chunk]
        out.append((c2[:, None, :] - 2 * torch.einsum("hnd,hcd->hnc", xs, centroids)).argmin(-1))
    return torch.cat(out, dim=1) if out else torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
