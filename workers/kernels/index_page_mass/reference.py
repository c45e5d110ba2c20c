"""Torch reference of Top-K's page mass (the path without the CPU kernel, and the kernel's oracle).

The same ops the selector ran before the kernel: each query row's softmax over the mid tokens' logits, the mean
over a KV head's group of query rows, tokens of the boundary pages outside the mid region at mass 0, and the sum
per page.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["page_mass_ref"]


def page_mass_ref(logits: torch.Tensor, start: int, end: int, page: int) -> torch.Tensor:
    """Scaled logits ``[T, Hkv, G, end - start]`` of tokens ``[start, end)`` -> each KV head's group-mean softmax
    mass summed per page ``[T, Hkv, pages]`` (pages ``start // page`` to ``ceil(end / page)``), float32."""
    p0, p1 = start // page, -(-end // page)
    mass = torch.softmax(logits.float(), dim=-1).nan_to_num_(0.0).mean(dim=-2)  # -inf logits: mass 0
    mass = F.pad(mass, (start - p0 * page, p1 * page - end))
    return mass.view(*mass.shape[:-1], p1 - p0, page).sum(-1)
