"""Public launcher of RoPE: validates the call, then runs the Triton kernel or the torch reference.

One launch rotates every query and key head of every token of a layer (``triton.py``) for bf16 tensors (on
CUDA by default); elsewhere (the CPU, other dtypes, or ``use_triton=False``) the torch reference serves, which
is transformers' own formula.
"""

from __future__ import annotations

import torch

from ..launch import next_pow2, triton_available
from .reference import apply_rope_ref

__all__ = ["apply_rope"]

_KERNEL_DTYPES = (torch.bfloat16,)
"""Dtypes the kernel reproduces bit for bit (it rounds on bf16's bits; float32 products could be fused into
FMAs by the compiler)."""


def _fail(msg: str) -> None:
    raise ValueError(f"apply_rope: {msg}")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, Hq, T, D]``, k ``[B, Hkv, T, D]`` (any strides, channels contiguous), cos, sin ``[B, T, D]`` -> the
    rotated q, k (new tensors laid out like q and k), equal to ``apply_rope_ref``."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        _fail(f"need q [B, Hq, T, D], k [B, Hkv, T, D], cos and sin [B, T, D]; got {tuple(q.shape)}, "
              f"{tuple(k.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or cos.shape[1:] != (t, d) or cos.shape[0] not in (1, b) or d % 2:
        _fail(f"shapes disagree (or an odd head dim): q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}")
    same = {x.dtype for x in (q, k, cos, sin)} == {q.dtype} and {x.device for x in (q, k, cos, sin)} == {q.device}
    if use_triton is None:
        use_triton = q.is_cuda and triton_available() and q.dtype in _KERNEL_DTYPES
    if not use_triton or not same or q.dtype not in _KERNEL_DTYPES or any(x.stride(-1) != 1 for x in (q, k, cos, sin)):
        return apply_rope_ref(q, k, cos, sin)
    from .triton import _rope_kernel

    qo, ko = torch.empty_like(q), torch.empty_like(k)
    hq, hkv = q.shape[1], k.shape[1]
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    if b * t and hq + hkv:
        _rope_kernel[(b * t, hq + hkv)](q, k, cos, sin, qo, ko, t, hq, q.stride(0), q.stride(1), q.stride(2),
                                        k.stride(0), k.stride(1), k.stride(2), cb, cos.stride(1), sb, sin.stride(1),
                                        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1),
                                        ko.stride(2), HALF=d // 2, BLOCK=next_pow2(d // 2), num_warps=1)
    return qo, ko
