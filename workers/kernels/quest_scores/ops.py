"""Public launcher of Quest's page upper-bound logits: validates the call, then runs the Triton kernel or the
torch reference.

``quest_upper_bounds`` scores query rows against the stacked, transposed page bounds (``StackedBounds``'s
``[Hkv, 2D, U]`` kmax-over-kmin layout) in one launch on CUDA; elsewhere (or with ``use_triton=False``) the
torch reference serves (CPU decoding in the tests' interpreter would be slow; the kernel's own tests pass
``use_triton=True``). Kernel tuning is a
``QuestScoresConfig`` argument, never module state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..launch import check_tuning, interpreting, next_pow2, triton_available
from .reference import quest_upper_bounds_ref

__all__ = ["DEFAULT_QUEST_SCORES", "QuestScoresConfig", "member_offsets", "quest_upper_bounds",
           "quest_upper_bounds_members"]

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


def member_offsets(kbs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each member's bounds' distance from the first's, in elements (``quest_upper_bounds_members``' table: make
    it once, outside a CUDA graph capture, for bounds that stay where they are)."""
    if not kbs:
        _fail("need at least one member's bounds")
    base, size = kbs[0].data_ptr(), kbs[0].element_size()
    offsets = []
    for kb in kbs:
        delta = kb.data_ptr() - base
        if delta % size:
            _fail("members' bounds must be aligned to their element size")
        offsets.append(delta // size)
    return torch.tensor(offsets, dtype=torch.int64, device=kbs[0].device)


def quest_upper_bounds_members(q: torch.Tensor, kbs: Sequence[torch.Tensor], scale: float, *,
                               offsets: torch.Tensor | None = None, use_triton: bool | None = None,
                               config: QuestScoresConfig = DEFAULT_QUEST_SCORES) -> torch.Tensor:
    """``quest_upper_bounds`` of several members at once: member ``m``'s one query token over its own bounds.

    Parameters
    ----------
    q : [M, Hkv, G, D], any strides
        One query token per member.
    kbs : M tensors [Hkv, 2D, U]
        Each member's bounds, as ``quest_upper_bounds`` takes them; all of one dtype, shape and strides (members
        of equal prefix length and page range), on q's device.
    offsets : [M] int64, optional
        ``member_offsets(kbs)``, made beforehand (a CUDA graph capture cannot copy it to the device);
        made here when None.

    Returns
    -------
    [M, Hkv, G, U] float32
        Row ``m`` equals ``quest_upper_bounds(q[m:m + 1], kbs[m], scale)`` (the same kernel arithmetic).
    """
    if q.dim() != 4 or len(kbs) != q.shape[0]:
        _fail(f"q must be [M, Hkv, G, D] with one member per bounds tensor, got {tuple(q.shape)} and {len(kbs)}")
    for kb in kbs:
        _validate(q[:1], kb, scale)
        if (kb.shape, kb.stride(), kb.dtype) != (kbs[0].shape, kbs[0].stride(), kbs[0].dtype):
            _fail(f"members' bounds must share shape, strides and dtype: {tuple(kbs[0].shape)} {kbs[0].stride()} "
                  f"{kbs[0].dtype} vs {tuple(kb.shape)} {kb.stride()} {kb.dtype}")
    if offsets is not None and (offsets.shape != (len(kbs),) or offsets.dtype != torch.int64
                                or offsets.device != q.device):
        _fail(f"offsets must be [M={len(kbs)}] int64 on {q.device}, got {offsets.dtype} {tuple(offsets.shape)} "
              f"on {offsets.device}")
    if use_triton is None:
        use_triton = q.is_cuda and triton_available()
    if not use_triton:
        return torch.cat([quest_upper_bounds_ref(q[m:m + 1], kb, scale) for m, kb in enumerate(kbs)])
    m_count, hkv, g, _ = q.shape
    out = _empty(m_count, hkv, g, kbs[0].shape[2], dtype=torch.float32, device=q.device)
    if out.numel():
        table = offsets if offsets is not None else member_offsets(kbs)
        _launch(q.to(kbs[0].dtype), kbs[0], float(scale), out, config, offsets=table)
    return out


def _launch(q: torch.Tensor, kb: torch.Tensor, scale: float, out: torch.Tensor, config: QuestScoresConfig,
            offsets: torch.Tensor | None = None) -> None:
    import triton

    from .triton import _quest_scores_kernel

    t, hkv, g, d = q.shape
    u = kb.shape[2]
    members = offsets is not None
    m = g if members else t * g  # rows sharing one bounds tensor
    block_m = min(config.max_rows, max(_DOT_MIN, next_pow2(m)))
    block_k = min(config.block_k, max(_DOT_MIN, next_pow2(d)))
    row_blocks = triton.cdiv(m, block_m)
    grid = (hkv, triton.cdiv(u, config.block_u), row_blocks * (t if members else 1))
    _quest_scores_kernel[grid](q, kb, offsets if members else out, out, m, u, g, hkv, row_blocks, *q.stride(),
                               kb.stride(0), kb.stride(1), scale, D=d, BLOCK_M=block_m, BLOCK_U=config.block_u,
                               BLOCK_K=block_k, MEMBERS=members, INTERPRET=interpreting(),
                               num_warps=config.num_warps, num_stages=config.num_stages)
