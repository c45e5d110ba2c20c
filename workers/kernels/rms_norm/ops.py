"""Public launcher of RMSNorm: validates the call, then runs the Triton kernel or the torch reference.

One launch normalizes every row (``triton.py``) of bf16 inputs with a bf16 weight (on CUDA by default);
elsewhere (the CPU, other dtypes, or ``use_triton=False``) the torch reference serves, which is transformers'
own module arithmetic.
"""

from __future__ import annotations

import torch

from ..launch import next_pow2, triton_available
from .reference import rms_norm_ref

__all__ = ["rms_norm"]

_KERNEL_DTYPES = (torch.bfloat16,)
"""Dtypes the kernel serves (it rounds the normalized row on bf16's bits)."""
MAX_WIDTH = 1 << 15
"""Widest row the kernel holds at once (wider rows use the reference)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """``weight * normalized(x)`` over x's last dim (``[..., N]``; ``weight [N]``), as ``rms_norm_ref``."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight must be [N={x.shape[-1]}], got {tuple(weight.shape)}")
    if use_triton is None:
        use_triton = x.is_cuda and triton_available() and x.dtype in _KERNEL_DTYPES
    n = x.shape[-1]
    if (not use_triton or x.dtype not in _KERNEL_DTYPES or weight.dtype != x.dtype or weight.device != x.device
            or n > MAX_WIDTH or x.stride(-1) != 1):
        return rms_norm_ref(x, weight, eps)
    from .triton import _rms_norm_kernel

    rows = x.reshape(-1, n)  # a view for the usual [B, T, N] activations (a copy only for odd strides)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), float(eps),
                                           BLOCK=next_pow2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(x.shape)
