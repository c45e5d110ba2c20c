"""Public launcher of the page gather: validates the call, then runs the Triton kernel or the torch reference.

``gather_pages`` copies scattered raw pages (pinned host memory read in place, or device memory) into
GPU page-cache slots in one launch on CUDA; elsewhere (or with ``use_triton=False``) the torch reference
serves. Kernel tuning is a ``GatherConfig`` argument, never module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import check_tuning, triton_available
from .reference import gather_pages_ref

__all__ = ["GatherConfig", "gather_pages", "triton_available"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_WARPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True, kw_only=True)
class GatherConfig:
    """Tuning of the Triton gather (results do not depend on it)."""

    block_bytes: int = 4096
    """Bytes each program copies at most (a K or V block is split into such chunks); a power of two."""
    num_warps: int = 4
    """Warps per program."""
    whole_page: bool = False
    """One program copies a page's K and V blocks (fewer programs; ``block_bytes`` unused)."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block_bytes",), warps=_WARPS)


DEFAULT_GATHER = GatherConfig()


def _fail(msg: str) -> None:
    raise ValueError(f"gather_pages: {msg}")


def _validate(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              dst_slots: torch.Tensor, block_bytes: int) -> None:
    if src.dtype != torch.uint8 or src.dim() != 2 or not src.is_contiguous():
        _fail(f"src must be contiguous uint8 [n, page_bytes], got {src.dtype} {tuple(src.shape)}; "
              "pass the raw pages viewed as bytes (.contiguous().view(torch.uint8))")
    if src.shape[1] < 2 * block_bytes:
        _fail(f"page_bytes {src.shape[1]} < K+V block bytes {2 * block_bytes}; block_bytes is one page's K "
              "block (page_size * head_dim * element size)")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype or not (k_pool.is_contiguous()
                                                                          and v_pool.is_contiguous()):
        _fail("k_pool and v_pool must be contiguous tensors of one shape and dtype")
    if src_rows.shape != dst_slots.shape or src_rows.dim() != 1:
        _fail(f"src_rows and dst_slots must be 1-D of one length, got {tuple(src_rows.shape)} and "
              f"{tuple(dst_slots.shape)}")
    if src_rows.dtype not in (torch.int32, torch.int64) or dst_slots.dtype not in (torch.int32, torch.int64):
        _fail(f"src_rows and dst_slots must be int32/int64, got {src_rows.dtype} and {dst_slots.dtype}")
    if src_rows.device != k_pool.device or dst_slots.device != k_pool.device:
        _fail(f"src_rows and dst_slots must be on the pools' device {k_pool.device}; move them with .to()")


def gather_pages(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 dst_slots: torch.Tensor, *, block_bytes: int, use_triton: bool | None = None,
                 skip_negative: bool = False, config: GatherConfig = DEFAULT_GATHER) -> None:
    """Copy K and V of pages ``src[src_rows]`` into slots ``dst_slots`` of ``k_pool``/``v_pool``.

    Parameters
    ----------
    src : [n_src, page_bytes] uint8
        Raw pages. With CUDA pools: pinned host memory (read in place) or memory on the pools' device.
    src_rows, dst_slots : [m] int32/int64, on the pools' device
        Source row and destination slot of each page.
    k_pool, v_pool : [rows, D], model dtype
        Page-cache pools; slot ``s`` is rows ``[s * P, (s + 1) * P)`` with ``P * D * elem = block_bytes``.
    block_bytes : int
        Bytes of one page's K (or V) block.
    use_triton : bool, optional
        Force the Triton kernel (e.g. under the interpreter) or the torch reference; default: CUDA pools
        with Triton installed.
    skip_negative : bool
        Entries with ``src_rows[i] < 0`` copy nothing (their ``dst_slots`` are not read). The Triton
        path stays fixed-shape (no sync); the torch path filters the entries (a sync on CUDA).
    config : GatherConfig
        Tuning of the Triton kernel.
    """
    _validate(src, src_rows, k_pool, v_pool, dst_slots, block_bytes)
    if src_rows.shape[0] == 0:
        return
    if use_triton is None:
        use_triton = k_pool.is_cuda and triton_available()
    if use_triton:
        _launch(src, src_rows, k_pool, v_pool, dst_slots, block_bytes, skip_negative, config)
    else:
        gather_pages_ref(src, src_rows, k_pool, v_pool, dst_slots, block_bytes=block_bytes,
                         skip_negative=skip_negative)


def _word_bytes(*sizes: int) -> int:
    return next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))


def _launch(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            dst_slots: torch.Tensor, block_bytes: int, skip_negative: bool, config: GatherConfig) -> None:
    import triton

    from .triton import _gather_pages_kernel, _gather_whole_pages_kernel

    page_bytes = src.shape[1]
    w = _word_bytes(page_bytes, block_bytes, k_pool.element_size() * k_pool.shape[-1])
    word = _WORDS[w]
    block_words = block_bytes // w
    args = (src.view(-1).view(word), src_rows, k_pool.view(-1).view(torch.uint8).view(word),
            v_pool.view(-1).view(torch.uint8).view(word), dst_slots, page_bytes // w, block_words)
    if config.whole_page:
        _gather_whole_pages_kernel[(src_rows.shape[0],)](*args, BLOCK=triton.next_power_of_2(block_words),
                                                         SKIP_NEG=skip_negative, num_warps=config.num_warps)
        return
    block = min(max(1, config.block_bytes // w), triton.next_power_of_2(block_words))
    grid = (src_rows.shape[0], 2, triton.cdiv(block_words, block))
    _gather_pages_kernel[grid](*args, BLOCK=block, SKIP_NEG=skip_negative, num_warps=config.num_warps)
