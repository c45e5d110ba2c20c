"""Public launcher of a single row's page entries: validates the call, then runs the Triton kernel or the torch
reference.

One decode row of a page step (``workers.methods.page_step``) attends, per KV head, the tokens of its ``n``
picked pages (page by page) and then the ``n_anchor`` anchor tokens. ``page_entries`` turns the picked page
ids and the first pool rows of the fetched pages into those entries' pool rows and bias, the picked token
ids and the count of picked mid tokens: one launch on CUDA (the torch form is ~15 small kernels), fixed
shapes for a fixed ``n`` and no device -> host copy, so it can be captured in a CUDA graph. Elsewhere (or
with ``use_triton=False``) the torch reference serves (CPU decoding in the tests' interpreter would be slow;
the kernel's own tests pass ``use_triton=True``); on the CPU a C++ kernel (``kernel.cpp``, the reference's
exact results in one call) serves where it builds. Kernel tuning is a ``PageEntriesConfig`` argument, never
module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import check_tuning, next_pow2, triton_available
from .cpu import cpu_kernel_available, page_entries_cpu
from .entries import PageEntries
from .reference import page_entries_ref

__all__ = ["DEFAULT_PAGE_ENTRIES", "PageEntriesConfig", "page_entries"]

_WARPS = (1, 2, 4, 8, 16)
_MIN_BLOCK = 128  # one lane per thread of 4 warps: smaller blocks save nothing
_empty = torch.empty  # outputs are allocated here (tests poison them)


@dataclass(frozen=True, kw_only=True)
class PageEntriesConfig:
    """Tuning of the Triton kernel (results do not depend on it)."""

    block: int = 1024
    """Entries per program at most; a power of two."""
    count_block: int = 1024
    """Page ids the counting program reads per loop step at most; a power of two."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block", "count_block"), warps=_WARPS)


DEFAULT_PAGE_ENTRIES = PageEntriesConfig()


def _fail(msg: str) -> None:
    raise ValueError(f"page_entries: {msg}")


def _validate(picked: torch.Tensor, first_rows: torch.Tensor, anchor_slot: torch.Tensor,
              anchor_offset: torch.Tensor, page_size: int, lo: int, hi: int, pool_rows: int) -> None:
    for name, x, dims in (("picked", picked, 2), ("first_rows", first_rows, 2), ("anchor_slot", anchor_slot, 1),
                          ("anchor_offset", anchor_offset, 1)):
        if x.dim() != dims or x.dtype != torch.int64:
            _fail(f"{name} must be a {dims}-d int64 tensor, got {x.dtype} {tuple(x.shape)}")
        if x.device != picked.device:
            _fail(f"{name} is on {x.device} but picked on {picked.device}; move them to one device")
    hkv, n = picked.shape
    if first_rows.shape[0] != hkv or first_rows.shape[1] < n:
        _fail(f"first_rows must be [Hkv={hkv}, n + na] with n={n} picked pages first, got {tuple(first_rows.shape)}")
    if anchor_offset.shape != anchor_slot.shape:
        _fail(f"anchor_slot {tuple(anchor_slot.shape)} and anchor_offset {tuple(anchor_offset.shape)} must match")
    if anchor_slot.numel() and first_rows.shape[1] == n:
        _fail("anchors need their pages' first rows after the picked pages' in first_rows (got none)")
    if page_size < 1 or pool_rows < 1 or hi < lo:
        _fail(f"need page_size >= 1, pool_rows >= 1 and lo <= hi, got page_size={page_size}, "
              f"pool_rows={pool_rows}, lo={lo}, hi={hi}")


def page_entries(picked: torch.Tensor, first_rows: torch.Tensor, anchor_slot: torch.Tensor,
                 anchor_offset: torch.Tensor, *, page_size: int, lo: int, hi: int, pool_rows: int,
                 use_triton: bool | None = None, use_cpu_kernel: bool = True,
                 config: PageEntriesConfig = DEFAULT_PAGE_ENTRIES) -> PageEntries:
    """One row's attention entries over its picked pages and the anchor tokens (see ``PageEntries``).

    Parameters
    ----------
    picked : [Hkv, n] int64, any strides
        Picked page ids per KV head (distinct per head), in any order.
    first_rows : [Hkv, n + na] int64, any strides, on picked's device
        First pool row of each fetched page: the picked pages, then the ``na`` anchor pages
        (``LayerKV.step_pages``' third result).
    anchor_slot, anchor_offset : [n_anchor] int64
        Per anchor token: its page's position among the anchor pages, and its offset inside that page.
    page_size : int
        Tokens per page.
    lo, hi : int
        The mid region ``[lo, hi)``: picked tokens outside it get bias ``-inf``.
    pool_rows : int
        Rows of the K/V pool the entries index (rows are clamped into it: a masked entry past the prefix
        still reads a real row).
    use_triton : bool, optional
        Force the Triton kernel (e.g. on CPU under the interpreter) or the torch reference; default: Triton
        for CUDA tensors when Triton is installed.
    use_cpu_kernel : bool
        Without Triton, CPU tensors run the C++ kernel (``cpu.py``: the reference's results, plus ``mid_rows``
        and ``valid``) where it builds; False: the torch reference.
    config : PageEntriesConfig
        Tuning of the Triton kernel.
    """
    _validate(picked, first_rows, anchor_slot, anchor_offset, page_size, lo, hi, pool_rows)
    if use_triton is None:
        use_triton = picked.is_cuda and triton_available()
    if not use_triton:
        if picked.device.type == "cpu" and use_cpu_kernel and cpu_kernel_available():
            return page_entries_cpu(picked, first_rows, anchor_slot, anchor_offset, page_size=page_size, lo=lo,
                                    hi=hi, pool_rows=pool_rows)
        return page_entries_ref(picked, first_rows, anchor_slot, anchor_offset, page_size=page_size, lo=lo,
                                hi=hi, pool_rows=pool_rows)
    hkv, n = picked.shape
    e = n * page_size + anchor_slot.numel()
    dev = picked.device
    out = PageEntries(rows=_empty(1, hkv, e, dtype=torch.int64, device=dev),
                      bias=_empty(1, hkv, e, dtype=torch.float32, device=dev),
                      tokens=_empty(1, hkv, n * page_size, dtype=torch.int64, device=dev),
                      n_distinct=_empty((), dtype=torch.int64, device=dev))
    _launch(picked, first_rows, anchor_slot, anchor_offset, out, page_size, lo, hi, pool_rows, config)
    return out


def _launch(picked: torch.Tensor, first_rows: torch.Tensor, anchor_slot: torch.Tensor, anchor_offset: torch.Tensor,
            out: PageEntries, page_size: int, lo: int, hi: int, pool_rows: int, config: PageEntriesConfig) -> None:
    import triton

    from .triton import _page_entries_kernel

    hkv, n = picked.shape
    e = out.rows.shape[2]
    block = min(config.block, max(_MIN_BLOCK, next_pow2(e)))
    count_block = min(config.count_block, max(_MIN_BLOCK, next_pow2(hkv * n)))
    n_blocks = triton.cdiv(e, block)
    _page_entries_kernel[(hkv * n_blocks + 1,)](
        picked, first_rows, anchor_slot, anchor_offset, out.rows, out.bias, out.tokens, out.n_distinct, n, e,
        n_blocks, hkv, hkv * n, lo, hi, max(lo, hi - 1), pool_rows, *picked.stride(), *first_rows.stride(),
        anchor_slot.stride(0), anchor_offset.stride(0), PAGE=page_size, BLOCK=block, COUNT_BLOCK=count_block,
        num_warps=config.num_warps)
