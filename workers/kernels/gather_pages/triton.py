"""Triton kernels of the page gather: raw page bytes -> K and V page-cache slots, one launch.

Both copy words (the widest integer type dividing the page, block and row sizes) and compute offsets
in int64. ``SKIP_NEG``: an entry whose source row is negative copies nothing (its loads and stores are
masked), so a fixed-shape launch over a whole request with cache hits marked -1 needs no sync.

``_gather_pages_kernel``
    grid ``(m, 2, cdiv(block_words, BLOCK))``: program ``(i, part, c)`` copies words
    ``[c * BLOCK, (c + 1) * BLOCK)`` of block ``part`` (0: K, 1: V) of entry ``i``.
``_gather_whole_pages_kernel``
    grid ``(m,)``: program ``i`` copies both blocks of entry ``i`` (``BLOCK >= block_words``): fewer,
    larger programs.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
