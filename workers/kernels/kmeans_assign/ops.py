"""Public launcher of the k-means assignment step: validates the call, then runs the Triton kernel or the
torch reference.

``kmeans_assign`` gives each point its nearest centroid (Euclidean; ties to the lower index) in one launch
on CUDA, without materialising the ``[H, n, C]`` distances; elsewhere (or with ``use_triton=False``) the
torch reference serves (CPU k-means in the tests' interpreter would be slow; the kernel's own tests pass
``use_triton=True``). Kernel tuning is a ``KmeansAssignConfig`` argument, never module state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..launch import check_tuning, interpreting, next_pow2, triton_available
from .reference import kmeans_assign_ref

__all__ = ["DEFAULT_KMEANS_ASSIGN", "KmeansAssignConfig", "kmeans_assign"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_WARPS = (1, 2, 4, 8, 16)
_PRECISIONS = ("tf32", "ieee")
_DOT_MIN = 16  # tl.dot needs every block dimension >= 16
MAX_HEAD_DIM = 256
"""Largest ``D`` the kernel takes: a program holds its ``[block_n, D]`` points in registers."""
_empty = torch.empty  # the output is allocated here (tests poison it)


@dataclass(frozen=True, kw_only=True)
class KmeansAssignConfig:
    """Tuning of the Triton kernel (labels do not depend on it beyond float32 summation order)."""

    block_n: int = 128
    """Points per program; a power of two >= 16."""
    block_c: int = 64
    """Centroids per loop step (one ``[block_n, block_c]`` distance block in registers); a power of two >= 16."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 3
    """Pipeline depth of the centroid tiles (tiles in flight per program); >= 1."""
    fp32_precision: Literal["tf32", "ieee"] = "tf32"
    """Products of float32 operands: ``"tf32"`` on tensor cores (operands rounded to 10 mantissa bits, float32
    sums), or ``"ieee"`` float32 FMAs (as the torch reference; several times slower). bf16/fp16 operands
    always multiply exactly on tensor cores."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block_n", "block_c"), at_least=_DOT_MIN, warps=_WARPS, stages=True)
        if self.fp32_precision not in _PRECISIONS:
            raise ValueError(f"KmeansAssignConfig.fp32_precision must be one of {_PRECISIONS}, "
                             f"got {self.fp32_precision!r}")


DEFAULT_KMEANS_ASSIGN = KmeansAssignConfig()


def _fail(msg: str) -> None:
    raise ValueError(f"kmeans_assign: {msg}")


def _validate(x: torch.Tensor, centroids: torch.Tensor) -> None:
    if x.dim() != 3 or x.dtype not in _FLOATS:
        _fail(f"x must be a float tensor [H, n, D] (bf16/fp16/fp32), got {x.dtype} {tuple(x.shape)}")
    if centroids.dim() != 3 or centroids.dtype not in _FLOATS:
        _fail(f"centroids must be a float tensor [H, C, D] (bf16/fp16/fp32), got {centroids.dtype} "
              f"{tuple(centroids.shape)}")
    if centroids.shape[0] != x.shape[0] or centroids.shape[2] != x.shape[2]:
        _fail(f"centroids {tuple(centroids.shape)} do not match x {tuple(x.shape)}: expected "
              f"[H={x.shape[0]}, C, D={x.shape[2]}]")
    if centroids.shape[1] < 1:
        _fail("there must be at least one centroid (C >= 1)")
    if centroids.device != x.device:
        _fail(f"x is on {x.device} but centroids on {centroids.device}; move them to one device")


def kmeans_assign(x: torch.Tensor, centroids: torch.Tensor, *, use_triton: bool | None = None,
                  config: KmeansAssignConfig = DEFAULT_KMEANS_ASSIGN) -> torch.Tensor:
    """Index of each point's nearest centroid (Euclidean), ties to the lower index.

    Parameters
    ----------
    x : [H, n, D] bf16/fp16/fp32, any strides
        Points, one independent problem per head ``H``.
    centroids : [H, C, D] bf16/fp16/fp32, any strides, on x's device, C >= 1
        Cast to x's dtype for the products (exact unless x is narrower); ``||c||^2`` from them in float32.
    use_triton : bool, optional
        Force the Triton kernel (e.g. on CPU under the interpreter) or the torch reference; default: Triton
        for CUDA tensors when Triton is installed. The kernel takes ``D <= MAX_HEAD_DIM``.
    config : KmeansAssignConfig
        Tuning of the Triton kernel.

    Returns
    -------
    [H, n] int64
        ``argmin_c ||c||^2 - 2 x . c``. The reference computes it in float32 throughout; the kernel sums
        float32 products of (for float32 x under ``"tf32"``: tf32-rounded) operands, so on near-ties the
        two may pick different centroids of (nearly) equal distance.
    """
    _validate(x, centroids)
    if use_triton is None:
        use_triton = x.is_cuda and triton_available()
    if not use_triton:
        return kmeans_assign_ref(x, centroids)
    if x.shape[2] > MAX_HEAD_DIM:
        _fail(f"the Triton kernel takes D <= {MAX_HEAD_DIM}, got D={x.shape[2]} (use use_triton=False)")
    h, n, _ = x.shape
    out = _empty(h, n, dtype=torch.int64, device=x.device)
    if out.numel():
        c2 = centroids.float().square().sum(-1).contiguous()  # [H, C], tiny next to the products
        _launch(x, centroids.to(x.dtype), c2, out, config)
    return out


def _launch(x: torch.Tensor, c: torch.Tensor, c2: torch.Tensor, out: torch.Tensor,
            config: KmeansAssignConfig) -> None:
    import triton

    from .triton import _kmeans_assign_kernel

    h, n, d = x.shape
    grid = (h, triton.cdiv(n, config.block_n))
    _kmeans_assign_kernel[grid](x, c, c2, out, n, c.shape[1], *x.stride(), *c.stride(), D=d,
                                BLOCK_N=config.block_n, BLOCK_C=config.block_c,
                                BLOCK_D=max(_DOT_MIN, next_pow2(d)), PRECISION=config.fp32_precision,
                                INTERPRET=interpreting(), num_warps=config.num_warps,
                                num_stages=config.num_stages)
