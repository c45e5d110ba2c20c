"""Triton kernel of the page plan: one program per KV head of one layer (tables offset to the layer).

Program ``h`` loads the head's requested pages, looks them up, stamps the hits, sorts the ``(stamp, slot)``
keys of the plan's window of ``W`` slots (``BLOCK_W`` lanes, padded with ``KEY_MAX``) into ``scratch`` to
find its least recently used slots, gives the i-th miss the i-th victim, updates map, owner and stamp, and
writes the outputs and counters. Barriers order the hit stamps before the sort and the sort before its reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plan_kernel(pages, n, page_to_slot, slot_to_page, stamp, clock, counters, host_rows, src_rows,
                 dst_slots, rows, scratch, n_pages, S, W, P, page_size, BLOCK_P: tl.constexpr,
                 BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, KEY_MAX: tl.constexpr):
    """Program ``h``: the plan of KV head ``h`` of one layer (tables already offset to the layer)."""
    h = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    pg = tl.load(pages + h * n + j, mask=j < n, other=-1).to(tl.int64)
    ok = (pg >= 0) & (pg < n_pages)
    pgc = tl.where(ok, pg, 0)
    map_row = page_to_slot + h * (n_pages + 1)
    own_row = slot_to_page + h * (S + 1)
    st_row = stamp + h * (S + 1)
    base = h * S
    slot = tl.load(map_row + pgc, mask=ok, other=-1)
    hit = ok & (slot >= 0)
    miss = ok & (slot < 0)
    t = tl.load(clock + h) + 1
    tl.store(clock + h, t)
    t_vec = tl.zeros([BLOCK_P], dtype=tl.int64) + t
    tl.store(st_row + (slot - base), t_vec, mask=hit)
    tl.debug_barrier()  # the hit stamps are visible to every thread before the sort
    i = tl.arange(0, BLOCK_W)
    s = ((t - 1) * W + i) % S  # the window rotates by its width each plan
    st = tl.load(st_row + s, mask=i < W, other=0)
    key = tl.where(i < W, st * BLOCK_S + s, KEY_MAX)
    key = tl.sort(key)
    sc_row = scratch + h * BLOCK_S
    tl.store(sc_row + i, key % BLOCK_S)
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    vic = tl.load(sc_row + rank, mask=miss, other=0)
    old = tl.load(own_row + vic, mask=miss, other=-1)
    tl.store(map_row + old, tl.full([BLOCK_P], -1, tl.int64), mask=miss & (old >= 0))
    tl.store(map_row + pgc, vic + base, mask=miss)
    tl.store(own_row + vic, pg, mask=miss)
    tl.store(st_row + vic, t_vec, mask=miss)
    new = tl.where(miss, vic + base, slot)
    src = tl.load(host_rows + h * n_pages + pgc, mask=miss, other=-1)
    out = j < n
    tl.store(src_rows + h * n + j, tl.where(miss, src, -1), mask=out)
    tl.store(dst_slots + h * n + j, tl.where(miss, new, 0), mask=out)
    tl.store(rows + h * P + j, tl.where(ok, new * page_size, -1), mask=out)
    c = counters + h * 3
    tl.store(c, tl.load(c) + tl.sum(hit.to(tl.int64), 0))
    tl.store(c + 1, tl.load(c + 1) + tl.sum(miss.to(tl.int64), 0))
    tl.store(c + 2, tl.load(c + 2) + tl.sum(((j < n) & (pg >= n_pages)).to(tl.int64), 0))
