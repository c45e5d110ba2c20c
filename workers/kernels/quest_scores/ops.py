"""Public launcher of Quest's page upper-bound logits: validates the call, then runs the Triton kernel or the
torch reference.

``quest_upper_bounds`` scores query rows against the stacked, transposed page bounds (``StackedBounds``'s
``[Hkv, 2D, U]`` kmax-over-kmin layout) in one launch on CUDA; elsewhere (or with ``use_triton=False``) the
torch reference serves (CPU decoding in the tests' interpreter would be slow; the kernel's own tests pass
``use_triton=True``). Kernel tuning is a
``QuestScoresConfig`` argument, never module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import check_tuning, interpreting, next_pow2, triton_available
from .reference import quest_upper_bounds_ref

__all__ = ["DEFAULT_QUEST_SCORES", "QuestScoresConfig", "quest_upper_bounds"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_BOUNDS = (torch.bfloat16, torch.float16, torch.float32)
_WARPS = (1, 2, 4, 8, 16)
_DOT_MIN = 16  # tl.dot needs every block dimension >= 16
_empty = torch.empty  # the output is allocated here (tests poison it with NaN)


@dataclass(frozen=True, kw_only=True)
class QuestScoresConfig:
    """Tuning of the Triton kernel (results do not depend on it beyond float32 summation order)."""

    block_u: int = 128
    """Pages per program; a power of two >= 16."""
    block_k: int = 32
    """Channels per loop step (a kmax and a kmin tile of ``block_k x block_u`` each); a power of two >= 16,
    capped at the head dim rounded up to a power of two."""
    max_rows: int = 64
    """Query rows (``T * G``, padded to >= 16) per program at most; more rows split into more programs, each
    reading the bounds again. A power of two >= 16."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Pipeline depth of the bounds tiles (tiles in flight per program); >= 1."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block_u", "block_k", "max_rows"), at_least=_DOT_MIN, warps=_WARPS,
                     stages=True)


DEFAULT_QUEST_SCORES = QuestScoresConfig()


def _fail(msg: str) -> None:
    raise ValueError(f"quest_upper_bounds: {msg}")


def _validate(q: torch.Tensor, kb: torch.Tensor, scale: float) -> None:
    if q.dim() != 4 or q.dtype not in _FLOATS:
        _fail(f"q must be a float tensor [T, Hkv, G, D], got {q.dtype} {tuple(q.shape)}")
    if kb.dim() != 3 or kb.dtype not in _BOUNDS or (kb.shape[2] > 1 and kb.stride(2) != 1):
        _fail(f"kb must be a float tensor [Hkv, 2D, U] (kmax rows over kmin rows, transposed) whose pages are "
              f"contiguous, got {kb.dtype} {tuple(kb.shape)} with strides {kb.stride()}; build it as "
              "StackedBounds does (a page range of a contiguous stack)")
    if kb.shape[0] != q.shape[1] or kb.shape[1] != 2 * q.shape[3]:
        _fail(f"kb {tuple(kb.shape)} does not match q {tuple(q.shape)}: expected [Hkv={q.shape[1]}, "
              f"2D={2 * q.shape[3]}, U]")
    if kb.device != q.device:
        _fail(f"q is on {q.device} but kb on {kb.device}; move them to one device")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail(f"scale must be a Python float (e.g. 1/sqrt(D)), got {scale!r}")


def quest_upper_bounds(q: torch.Tensor, kb: torch.Tensor, scale: float, *, use_triton: bool | None = None,
                       config: QuestScoresConfig = DEFAULT_QUEST_SCORES) -> torch.Tensor:
    """Upper-bound logits of every query row over every page: ``scale * (q⁺ . kmax + q⁻ . kmin)``.

    Parameters
    ----------
    q : [T, Hkv, G, D] bf16/fp16/fp32, any strides
        Query rows grouped by KV head. Cast to ``kb``'s dtype before the products (as the torch path does).
    kb : [Hkv, 2D, U] bf16/fp16/fp32, on q's device; pages contiguous (stride 1), any head and row strides
        (a page range of a contiguous stack)
        Page bounds, transposed: rows ``[:D]`` kmax, rows ``[D:]`` kmin, one column per page.
    scale : float
        Softmax scale applied to the logits.
    use_triton : bool, optional
        Force the Triton kernel (e.g. on CPU under the interpreter) or the torch reference; default: Triton
        for CUDA tensors when Triton is installed.
    config : QuestScoresConfig
        Tuning of the Triton kernel.

    Returns
    -------
    [T, Hkv, G, U] float32
        Products accumulated in float32 by the kernel; the reference rounds its matmul to ``kb``'s dtype.
    """
    _validate(q, kb, scale)
    if use_triton is None:
        use_triton = kb.is_cuda and triton_available()
    if not use_triton:
        return quest_upper_bounds_ref(q, kb, scale)
    t, hkv, g, _ = q.shape
    out = _empty(t, hkv, g, kb.shape[2], dtype=torch.float32, device=q.device)
    if out.numel():
        # torch casts q (tiny) when its dtype differs: round to nearest even, as the reference does; the
        # interpreter's own float32 -> bf16 cast truncates
        _launch(q.to(kb.dtype), kb, float(scale), out, config)
    return out


def _launch(q: torch.Tensor, kb: torch.Tensor, scale: float, out: torch.Tensor, config: QuestScoresConfig) -> None:
    import triton

    from .triton import _quest_scores_kernel

    t, hkv, g, d = q.shape
    u, m = kb.shape[2], t * g
    block_m = min(config.max_rows, max(_DOT_MIN, next_pow2(m)))
    block_k = min(config.block_k, max(_DOT_MIN, next_pow2(d)))
    grid = (hkv, triton.cdiv(u, config.block_u), triton.cdiv(m, block_m))
    _quest_scores_kernel[grid](q, kb, out, m, u, g, hkv, *q.stride(), kb.stride(0), kb.stride(1), scale, D=d,
                               BLOCK_M=block_m,
                               BLOCK_U=config.block_u, BLOCK_K=block_k,
                               INTERPRET=interpreting(), num_warps=config.num_warps,
                               num_stages=config.num_stages)
