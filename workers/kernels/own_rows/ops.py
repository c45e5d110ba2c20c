"""Public launcher of the own-row write: validates the call, then runs the Triton kernel or the torch reference.

Each member of a captured decode step writes its new token's K and V into its own buffer (``OwnKV``) at the
position its replay says. ``own_rows_table`` describes the members' buffers of one layer once (before a CUDA
graph capture: it copies a small table to the device); ``write_own_rows`` then writes every member's row in one
launch on CUDA, or with the reference's ``index_copy_`` per member elsewhere (or with ``use_triton=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..launch import next_pow2, triton_available
from .reference import write_own_rows_ref

__all__ = ["OwnRowsTable", "own_rows_table", "write_own_rows"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _fail(msg: str) -> None:
    raise ValueError(f"write_own_rows: {msg}")


@dataclass(frozen=True)
class OwnRowsTable:
    """The members' own K and V buffers of one layer, and where each lies from the first's (``own_rows_table``)."""

    ks: tuple[torch.Tensor, ...]
    vs: tuple[torch.Tensor, ...]
    """Member m's K and V buffers ``[Hkv, S_m, D]`` (views; channels contiguous)."""
    table: torch.Tensor
    """``[M, 4]`` int64 on their device: K start, V start (elements from ``ks[0]``), head stride, token stride."""


def own_rows_table(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> OwnRowsTable:
    """The table of members' K and V buffers ``[Hkv, S_m, D]`` of one layer (one dtype, head count, head dim and
    device; any sizes)."""
    if not ks or len(ks) != len(vs):
        _fail(f"need one K and one V buffer per member, got {len(ks)} and {len(vs)}")
    ref = ks[0]
    if ref.dim() != 3 or ref.dtype not in _FLOATS:
        _fail(f"buffers must be float [Hkv, S, D], got {ref.dtype} {tuple(ref.shape)}")
    rows = []
    for kb, vb in zip(ks, vs, strict=True):
        for x in (kb, vb):
            if (x.dim() != 3 or x.dtype != ref.dtype or x.device != ref.device or x.shape[0] != ref.shape[0]
                    or x.shape[2] != ref.shape[2] or x.stride(2) != 1):
                _fail(f"every buffer must be {ref.dtype} [Hkv={ref.shape[0]}, S, D={ref.shape[2]}] on {ref.device} "
                      f"with contiguous channels, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
        if kb.stride() != vb.stride():
            _fail(f"a member's K and V buffers must share strides, got {kb.stride()} and {vb.stride()}")
        rows.append([_elements_from(ref, kb), _elements_from(ref, vb), kb.stride(0), kb.stride(1)])
    table = torch.tensor(rows, dtype=torch.int64).to(ref.device)
    return OwnRowsTable(ks=tuple(ks), vs=tuple(vs), table=table)


def _elements_from(base: torch.Tensor, x: torch.Tensor) -> int:
    delta = x.data_ptr() - base.data_ptr()
    if delta % base.element_size():
        _fail("buffers must be aligned to their element size")
    return delta // base.element_size()


def write_own_rows(k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, own: OwnRowsTable, *,
                   use_triton: bool | None = None) -> None:
    """Member m's new rows k, v ``[M, Hkv, D]`` (any strides, channels contiguous) to row ``at[m]`` (``[M]``
    int64, on their device; each below its buffer's size, not checked: that would cost a sync) of its buffers."""
    m = len(own.ks)
    ref = own.ks[0]
    for name, x in (("k", k), ("v", v)):
        if x.shape != (m, ref.shape[0], ref.shape[2]) or x.dtype not in _FLOATS or x.device != ref.device:
            _fail(f"{name} must be float [M={m}, Hkv={ref.shape[0]}, D={ref.shape[2]}] on {ref.device}, got "
                  f"{x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(2) != 1:
            _fail(f"{name}'s channels must be contiguous, got strides {x.stride()}")
    if at.shape != (m,) or at.dtype != torch.int64 or at.device != ref.device:
        _fail(f"at must be [M={m}] int64 on {ref.device}, got {at.dtype} {tuple(at.shape)} on {at.device}")
    if use_triton is None:
        use_triton = ref.is_cuda and triton_available()
    if not use_triton:
        write_own_rows_ref(k, v, at, own.ks, own.vs)
        return
    from .triton import _own_rows_kernel

    d = ref.shape[2]
    _own_rows_kernel[(m, ref.shape[0])](k, v, at, own.table, ref, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                        D=d, BLOCK_D=next_pow2(d), num_warps=1)
