"""Torch reference of Quest's page upper-bound logits (the CPU path, and the Triton kernel's oracle).

The same ops as the selector ran before the kernel: ``[q⁺, q⁻]`` cast to the bounds' dtype, one batched
matmul per KV head in that dtype (its result rounded to it), then float32 and the scale.
"""

from __future__ import annotations

import torch

__all__ = ["quest_upper_bounds_ref"]


def quest_upper_bounds_ref(q: torch.Tensor, kb: torch.Tensor, scale: float) -> torch.Tensor:
    """Upper-bound logits ``[T, Hkv, G, U]`` float32 of ``q [T, Hkv, G, D]`` over ``kb [Hkv, 2D, U]``
    (kmax rows over kmin rows): ``scale * (q⁺ . kmax + q⁻ . kmin)``."""
    t, hkv, g, _ = q.shape
    qq = torch.cat([q.clamp_min(0), q.clamp_max(0)], dim=-1).to(kb.dtype)  # [T, Hkv, G, 2D]
    ub = torch.bmm(qq.permute(1, 0, 2, 3).reshape(hkv, t * g, -1), kb)  # [Hkv, T*G, U]
    return ub.view(hkv, t, g, -1).permute(1, 0, 2, 3).float() * scale
