"""Host -> GPU page copy in one launch: K and V blocks of scattered pages into GPU page-cache slots.

``gather_pages`` copies page ``src[src_rows[i]]`` (raw page bytes: K block, V block, padding) into
slot ``dst_slots[i]`` of the K and V pools (slot ``s`` is rows ``[s * P, (s + 1) * P)``). On CUDA one
Triton launch does every page: each program copies one 4 KiB-class block, reading ``src`` straight
from pinned, GPU-mapped host memory (or from GPU memory). Elsewhere plain torch indexing.
With ``skip_negative`` an entry whose source row is negative copies nothing (a fixed-shape launch over
a whole request in which cache hits are marked -1: no device -> host sync, CUDA-graph capturable).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

TRITON_CONFIG = {"block_bytes": 4096, "num_warps": 4, "whole_page": 0}
"""Bytes each program copies (at most; a K or V block is split into such chunks) and its warps; with
``whole_page`` one program copies a page's K and V blocks (fewer programs: ``block_bytes`` unused).
``bench/bench_offload.py`` sweeps them and may set the best for the run."""
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


if triton is not None:

    @triton.jit
    def _gather_pages_kernel(src, src_rows, dst_k, dst_v, dst_slots, page_words, block_words,
                             BLOCK: tl.constexpr, SKIP_NEG: tl.constexpr):
        """Program (i, part, c): words [c*BLOCK, (c+1)*BLOCK) of block ``part`` (0 K, 1 V) of page i
        (nothing when ``SKIP_NEG`` and its source row is negative)."""
        i = tl.program_id(0)
        part = tl.program_id(1)
        c = tl.program_id(2)
        s = tl.load(src_rows + i).to(tl.int64)
        d = tl.load(dst_slots + i).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < block_words
        if SKIP_NEG:
            mask = mask & (s >= 0)
            s = tl.maximum(s, 0)
            d = tl.maximum(d, 0)
        x = tl.load(src + s * page_words + part * block_words + offs, mask=mask)
        if part == 0:
            tl.store(dst_k + d * block_words + offs, x, mask=mask)
        else:
            tl.store(dst_v + d * block_words + offs, x, mask=mask)

    @triton.jit
    def _gather_whole_pages_kernel(src, src_rows, dst_k, dst_v, dst_slots, page_words, block_words,
                                   BLOCK: tl.constexpr, SKIP_NEG: tl.constexpr):
        """Program i: both blocks of page i (``BLOCK >= block_words``); fewer, larger programs."""
        i = tl.program_id(0)
        s = tl.load(src_rows + i).to(tl.int64)
        d = tl.load(dst_slots + i).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < block_words
        if SKIP_NEG:
            mask = mask & (s >= 0)
            s = tl.maximum(s, 0)
            d = tl.maximum(d, 0)
        k = tl.load(src + s * page_words + offs, mask=mask)
        v = tl.load(src + s * page_words + block_words + offs, mask=mask)
        tl.store(dst_k + d * block_words + offs, k, mask=mask)
        tl.store(dst_v + d * block_words + offs, v, mask=mask)


def _word_bytes(*sizes: int) -> int:
    return next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))


def _check(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           dst_slots: torch.Tensor, block_bytes: int) -> None:
    if src.dtype != torch.uint8 or src.dim() != 2 or not src.is_contiguous():
        raise ValueError(f"src must be contiguous uint8 [n, page_bytes], got {src.dtype} {tuple(src.shape)}")
    if src.shape[1] < 2 * block_bytes:
        raise ValueError(f"page_bytes {src.shape[1]} < K+V block bytes {2 * block_bytes}")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype or not (k_pool.is_contiguous()
                                                                          and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous tensors of one shape and dtype")
    if src_rows.shape != dst_slots.shape or src_rows.dim() != 1:
        raise ValueError("src_rows and dst_slots must be 1-D of one length")
    if src_rows.device != k_pool.device or dst_slots.device != k_pool.device:
        raise ValueError("src_rows and dst_slots must be on the pools' device")


def gather_pages(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 dst_slots: torch.Tensor, *, block_bytes: int, use_triton: bool | None = None,
                 skip_negative: bool = False) -> None:
    """Copy K and V of pages ``src[src_rows]`` into slots ``dst_slots`` of ``k_pool``/``v_pool``.

    Parameters
    ----------
    src : [n_src, page_bytes] uint8
        Raw pages. With CUDA pools: pinned host memory (read in place) or memory on the pools' device.
    src_rows, dst_slots : [m] int64, on the pools' device
        Source row and destination slot of each page.
    k_pool, v_pool : [rows, D], model dtype
        Page-cache pools; slot ``s`` is rows ``[s * P, (s + 1) * P)`` with ``P * D * elem = block_bytes``.
    block_bytes : int
        Bytes of one page's K (or V) block.
    use_triton : bool, optional
        Force the Triton kernel (e.g. under the interpreter) or the torch path; default: CUDA pools.
    skip_negative : bool
        Entries with ``src_rows[i] < 0`` copy nothing (their ``dst_slots`` are not read). The Triton
        path stays fixed-shape (no sync); the torch path filters the entries (a sync on CUDA).
    """
    _check(src, src_rows, k_pool, v_pool, dst_slots, block_bytes)
    m = src_rows.shape[0]
    if m == 0:
        return
    if use_triton is None:
        use_triton = k_pool.is_cuda and triton is not None
    if use_triton:
        _gather_triton(src, src_rows, k_pool, v_pool, dst_slots, block_bytes, skip_negative)
        return
    if skip_negative:
        keep = src_rows >= 0
        src_rows, dst_slots = src_rows[keep], dst_slots[keep]
    _gather_torch(src, src_rows, k_pool, v_pool, dst_slots, block_bytes)


def _gather_triton(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   dst_slots: torch.Tensor, block_bytes: int, skip_negative: bool = False) -> None:
    page_bytes = src.shape[1]
    w = _word_bytes(page_bytes, block_bytes, k_pool.element_size() * k_pool.shape[-1])
    word = _WORDS[w]
    block_words = block_bytes // w
    args = (src.view(-1).view(word), src_rows, k_pool.view(-1).view(torch.uint8).view(word),
            v_pool.view(-1).view(torch.uint8).view(word), dst_slots, page_bytes // w, block_words)
    if TRITON_CONFIG.get("whole_page", 0):
        _gather_whole_pages_kernel[(src_rows.shape[0],)](*args, BLOCK=triton.next_power_of_2(block_words),
                                                         SKIP_NEG=skip_negative,
                                                         num_warps=TRITON_CONFIG["num_warps"])
        return
    block = min(max(1, TRITON_CONFIG["block_bytes"] // w), triton.next_power_of_2(block_words))
    grid = (src_rows.shape[0], 2, triton.cdiv(block_words, block))
    _gather_pages_kernel[grid](*args, BLOCK=block, SKIP_NEG=skip_negative, num_warps=TRITON_CONFIG["num_warps"])


def _gather_torch(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  dst_slots: torch.Tensor, block_bytes: int) -> None:
    pages = src.index_select(0, src_rows.to(src.device)).to(k_pool.device)
    per_block = block_bytes // k_pool.element_size()
    n_slots = k_pool.numel() // per_block
    for pool, lo in ((k_pool, 0), (v_pool, block_bytes)):
        blocks = pages[:, lo : lo + block_bytes].contiguous().view(pool.dtype).view(-1, per_block)
        pool.view(-1)[: n_slots * per_block].view(n_slots, per_block).index_copy_(0, dst_slots, blocks)
