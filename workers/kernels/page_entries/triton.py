"""Triton kernel of a single row's page entries: rows, bias, token ids and the mid count in one launch.

Grid ``(Hkv * n_blocks + 1,)``. Program ``pid < Hkv * n_blocks`` takes entries
``[b * BLOCK, (b + 1) * BLOCK)`` of KV head ``h = pid // n_blocks`` (``b = pid % n_blocks``): entry ``e`` below
``n * PAGE`` is token ``e % PAGE`` of the head's picked page ``e // PAGE`` (pool row: that page's first row
plus the offset; bias ``-inf`` when its token id is outside ``[lo, hi)``; its id, clamped, goes to
``tokens``); entry ``e`` past it is anchor ``a = e - n * PAGE`` (pool row: the first row of the head's anchor
page ``n + anchor_slot[a]`` plus ``anchor_offset[a]``; bias 0). Rows are clamped to ``[0, pool_rows - 1]``.

The last program counts the picked tokens inside ``[lo, hi)`` over every head, page by page (a page's count
is the length of ``[page * PAGE, (page + 1) * PAGE) ∩ [lo, hi)``), in ``COUNT_BLOCK`` chunks, and stores the
total. Why a program of its own rather than per-program partial sums added atomically: the atomics need an
output zeroed first (a second launch per step), and the count reads only ``Hkv * n`` page ids (a few KB),
so one program finishes it while the others write the entries; the sum is also deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _page_entries_kernel(picked, first_rows, anchor_slot, anchor_offset, rows, bias, tokens, n_distinct, n,
                         n_entries, n_blocks, n_heads, n_pages, lo, hi, tok_max, pool_rows, s_ph, s_pn, s_fh, s_fn,
                         s_as, s_ao, PAGE: tl.constexpr, BLOCK: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    """Program ``pid``: a block of one head's entries, or (the last program) the mid count of all heads."""
    pid = tl.program_id(0)
    if pid < n_heads * n_blocks:
        h = (pid // n_blocks).to(tl.int64)
        e = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
        n_pick = n * PAGE
        ok = e < n_entries
        pick = ok & (e < n_pick)
        anc = ok & (e >= n_pick)
        i = e // PAGE
        j = e % PAGE
        pg = tl.load(picked + h * s_ph + i * s_pn, mask=pick, other=0).to(tl.int64)
        first = tl.load(first_rows + h * s_fh + i * s_fn, mask=pick, other=0).to(tl.int64)
        a = e - n_pick
        slot = tl.load(anchor_slot + a * s_as, mask=anc, other=0).to(tl.int64)
        off = tl.load(anchor_offset + a * s_ao, mask=anc, other=0).to(tl.int64)
        a_first = tl.load(first_rows + h * s_fh + (n + slot) * s_fn, mask=anc, other=0).to(tl.int64)
        row = tl.where(pick, first + j, a_first + off)
        row = tl.minimum(tl.maximum(row, 0), pool_rows - 1)
        tok = pg * PAGE + j
        outside = pick & ((tok < lo) | (tok >= hi))
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        at = h * n_entries + e
        tl.store(rows + at, row, mask=ok)
        tl.store(bias + at, tl.where(outside, zero - float("inf"), zero), mask=ok)
        tl.store(tokens + h * n_pick + e, tl.minimum(tl.maximum(tok, lo), tok_max), mask=pick)
    else:
        acc = tl.zeros([COUNT_BLOCK], dtype=tl.int64)
        k0 = 0
        while k0 < n_pages:  # with numpy >= 2.4 the interpreter's range() cannot take run-time bounds
            f = k0 + tl.arange(0, COUNT_BLOCK)
            m = f < n_pages
            hh = (f // n).to(tl.int64)
            pg = tl.load(picked + hh * s_ph + (f % n) * s_pn, mask=m, other=0).to(tl.int64)
            start = pg * PAGE
            c = tl.minimum(start + PAGE, hi) - tl.maximum(start, lo)
            acc += tl.where(m & (c > 0), c, 0)
            k0 += COUNT_BLOCK
        tl.store(n_distinct, tl.sum(acc, 0))
