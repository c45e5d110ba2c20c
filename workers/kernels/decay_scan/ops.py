"""Public launcher of the decay scan: validates the call, then runs the Triton kernels or the torch reference.

On CUDA (or with ``use_triton=True``, e.g. under ``TRITON_INTERPRET=1``) the forward and backward Triton
kernels run inside one autograd function; elsewhere the torch reference serves (autograd through its
loop). Kernel tuning is a ``DecayScanConfig`` argument, never module state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..launch import check_tuning, triton_available
from .reference import decay_scan_ref

__all__ = ["DecayScanConfig", "decay_scan", "triton_available"]


@dataclass(frozen=True, kw_only=True)
class DecayScanConfig:
    """Tuning of the Triton scan (results do not depend on it beyond float rounding)."""

    block_t: int = 64
    """Tokens per chunk (one associative scan each); a power of two."""
    block_d: int = 32
    """Channels per program; a power of two."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block_t", "block_d"))


DEFAULT_SCAN = DecayScanConfig()


def _validate(x: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor, h0: torch.Tensor | None) -> None:
    if x.dim() != 3 or g.shape != x.shape:
        raise ValueError(f"decay_scan: x and g must both be [N, H, D], got {tuple(x.shape)} and {tuple(g.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("decay_scan: cu_seqlens must be int32/int64 [S + 1] with S >= 1 (segment boundaries, "
                         f"starting at 0), got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != x.device or g.device != x.device:
        raise ValueError(f"decay_scan: g and cu_seqlens must be on x's device {x.device}; move them with .to()")
    if h0 is not None and (h0.shape != (cu_seqlens.numel() - 1, *x.shape[1:]) or h0.device != x.device):
        raise ValueError(f"decay_scan: h0 must be [S, H, D] = {(cu_seqlens.numel() - 1, *x.shape[1:])} on "
                         f"{x.device}, got {tuple(h0.shape)} on {h0.device}")


def decay_scan(x: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
               h0: torch.Tensor | None = None, *, use_triton: bool | None = None,
               config: DecayScanConfig = DEFAULT_SCAN) -> torch.Tensor:
    """Gated decaying memory over packed sequences: ``y_n = g_n ⊙ y_{n-1} + (1 − g_n) ⊙ x_n``.

    Parameters
    ----------
    x, g : [N, H, D]
        Inputs and gates (gates in [0, 1]) of ``N`` packed tokens; the last dimension contiguous.
    cu_seqlens : [S + 1] int32/int64, optional
        Segment boundaries (``0 = c_0 <= ... <= c_S = N``); each segment starts its own recurrence.
        Default: one segment of all ``N`` tokens.
    h0 : [S, H, D], optional
        The state before each segment's first token (default zeros).
    use_triton : bool, optional
        Force the Triton kernels (e.g. under the interpreter) or the torch reference; default: CUDA with
        Triton installed.
    config : DecayScanConfig
        Tuning of the Triton kernels.

    Returns
    -------
    y : [N, H, D] in x's dtype (state carried in float32), differentiable in x, g and h0.
    """
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, x.shape[0]], device=x.device, dtype=torch.int32)
    _validate(x, g, cu_seqlens, h0)
    if use_triton is None:
        use_triton = x.is_cuda and triton_available()
    if not use_triton:
        return decay_scan_ref(x, g, cu_seqlens, h0)
    return _DecayScan.apply(x, g, cu_seqlens, h0, config)


class _DecayScan(torch.autograd.Function):
    """The Triton forward and backward kernels as one differentiable op."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor, cu: torch.Tensor, h0: torch.Tensor | None,
                config: DecayScanConfig) -> torch.Tensor:
        x, g = x.contiguous(), g.contiguous()  # the backward kernel indexes dy, dx like x and dg like g
        h0c = h0.contiguous() if h0 is not None else None
        y = torch.empty_like(x)
        _launch_fwd(x, g, cu, h0c, y, config)
        ctx.save_for_backward(x, g, cu, y, *(() if h0c is None else (h0c,)))
        ctx.config, ctx.has_h0 = config, h0c is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, g, cu, y, *rest = ctx.saved_tensors
        h0 = rest[0] if ctx.has_h0 else None
        dy = dy.contiguous()
        dx, dg = torch.empty_like(x), torch.empty_like(g)
        dh0 = torch.empty_like(h0) if h0 is not None else None
        _launch_bwd(dy, x, g, y, h0, cu, dx, dg, dh0, ctx.config)
        return dx, dg, None, dh0, None


def _grid(x: torch.Tensor, cu: torch.Tensor, config: DecayScanConfig) -> tuple[int, int, int]:
    return (cu.numel() - 1, x.shape[1], -(-x.shape[2] // config.block_d))


def _h0_strides(h0: torch.Tensor | None) -> tuple[int, int]:
    return (h0.stride(0), h0.stride(1)) if h0 is not None else (0, 0)


def _launch_fwd(x: torch.Tensor, g: torch.Tensor, cu: torch.Tensor, h0: torch.Tensor | None, y: torch.Tensor,
                config: DecayScanConfig) -> None:
    from .triton import _fwd_kernel

    _fwd_kernel[_grid(x, cu, config)](
        x, g, h0 if h0 is not None else x, y, cu, x.stride(0), x.stride(1), g.stride(0), g.stride(1),
        y.stride(0), y.stride(1), *_h0_strides(h0), x.shape[2], HAS_H0=h0 is not None,
        BLOCK_T=config.block_t, BLOCK_D=config.block_d, num_warps=config.num_warps)


def _launch_bwd(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor, y: torch.Tensor, h0: torch.Tensor | None,
                cu: torch.Tensor, dx: torch.Tensor, dg: torch.Tensor, dh0: torch.Tensor | None,
                config: DecayScanConfig) -> None:
    from .triton import _bwd_kernel

    _bwd_kernel[_grid(x, cu, config)](
        dy, x, g, y, h0 if h0 is not None else x, cu, dx, dg, dh0 if dh0 is not None else dx,
        x.stride(0), x.stride(1), g.stride(0), g.stride(1), y.stride(0), y.stride(1), *_h0_strides(h0),
        x.shape[2], HAS_H0=h0 is not None, BLOCK_T=config.block_t, BLOCK_D=config.block_d,
        num_warps=config.num_warps)
