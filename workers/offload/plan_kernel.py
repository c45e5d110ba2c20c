"""One fetch's plan on the device: lookup, hit stamps, exact-LRU victims and map updates, fixed shape.

State of one layer (``PlanState`` holds all layers; head ``h`` owns the global slots
``[h * S, (h + 1) * S)``, so heads never share a slot and one program per head plans without races):

- ``page_to_slot [L, Hkv, n_pages + 1]`` int64: global slot of a resident page, -1 elsewhere;
- ``slot_to_page [L, Hkv, S + 1]`` int64: page in a slot (local index), -1 when empty;
- ``stamp [L, Hkv, S + 1]`` int64: fetch number of the slot's last use (0: never used);
- ``clock [L, Hkv]`` int64: fetches of the layer so far; ``counters [L, Hkv, 3]``: hits, misses,
  rejected ids (>= n_pages);
- the last column of each table is scratch for the torch path's masked scatters (never meaningful).

A fetch of ``pages [Hkv, n]`` (``n <= P``, ``S >= 2P``; -1 = padding), per head, in this order:
clock += 1 (= t); hits are stamped t; victims are the ``n`` slots with the smallest
``(stamp, slot)`` (none was stamped t: at most ``n`` hits, ``S - n >= n`` others); the i-th miss in
request order takes the i-th victim, whose page (if any) leaves the map; map, owner and stamp of the
victim are set. Outputs (``[Hkv, P]``, entries past ``n`` padding): ``src_rows`` (host-tier row of each
miss, -1 for hits and padding: the gather skips them), ``dst_slots`` (global slot, 0 when skipped)
and ``rows`` (first pool row of each requested page, -1 for padding and rejected ids).

Two implementations with the same result: ``plan_triton`` (one launch, one program per head: a
sort of the head's slot keys) and ``plan_torch`` (~20 torch ops: CPU, and the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: plan_torch serves
    triton = None

_KEY_MAX = 2**62
PLAN_CONFIG = {"num_warps": 0}
"""Warps of the plan kernel's one program per head; 0: by the slot block (8 from 1024 slots, else 4: on
the H200 at 128k, where the sort of 1024 keys dominates, 8 warps took 0.37 ms/token against 0.58).
``bench/bench_offload.py`` sweeps it."""


@dataclass(frozen=True, kw_only=True)
class PlanState:
    """Device tables of every layer (see the module docstring) and the per-layer outputs."""

    page_to_slot: torch.Tensor
    slot_to_page: torch.Tensor
    stamp: torch.Tensor
    clock: torch.Tensor
    counters: torch.Tensor
    host_rows: torch.Tensor
    """``[L, Hkv, n_pages]`` int64 host-tier row of every page."""
    src_rows: torch.Tensor
    """``[L, Hkv * P]`` int64 outputs (see the module docstring)."""
    dst_slots: torch.Tensor
    rows: torch.Tensor
    """``[L, Hkv, P]`` int64."""
    scratch: torch.Tensor
    """``[L, Hkv, BLOCK_S]`` int64: the sorted victims of the Triton path."""
    slots_per_head: int
    page_size: int

    @classmethod
    def empty(cls, *, host_rows: torch.Tensor, slots_per_head: int, pages_per_call: int, page_size: int
              ) -> PlanState:
        """Empty tables for ``host_rows [L, Hkv, n_pages]`` (on the cache's device)."""
        n_layers, heads, n_pages = host_rows.shape
        s, p, dev = slots_per_head, pages_per_call, host_rows.device

        def full(*shape: int, value: int = -1) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=dev)

        return cls(page_to_slot=full(n_layers, heads, n_pages + 1), slot_to_page=full(n_layers, heads, s + 1),
                   stamp=full(n_layers, heads, s + 1, value=0), clock=full(n_layers, heads, value=0),
                   counters=full(n_layers, heads, 3, value=0), host_rows=host_rows.to(torch.int64),
                   src_rows=full(n_layers, heads * p), dst_slots=full(n_layers, heads * p, value=0),
                   rows=full(n_layers, heads, p), scratch=full(n_layers, heads, _next_pow2(s), value=0),
                   slots_per_head=s, page_size=page_size)

    def reset(self) -> None:
        """Forget every cached page (counters kept)."""
        self.page_to_slot.fill_(-1)
        self.slot_to_page.fill_(-1)
        self.stamp.fill_(0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _plan_kernel(pages, n, page_to_slot, slot_to_page, stamp, clock, counters, host_rows, src_rows,
                     dst_slots, rows, scratch, n_pages, S, P, page_size, BLOCK_P: tl.constexpr,
                     BLOCK_S: tl.constexpr, KEY_MAX: tl.constexpr):
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
        s = tl.arange(0, BLOCK_S)
        st = tl.load(st_row + s, mask=s < S, other=0)
        key = tl.where(s < S, st * BLOCK_S + s, KEY_MAX)
        key = tl.sort(key)
        sc_row = scratch + h * BLOCK_S
        tl.store(sc_row + s, key % BLOCK_S)
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
        out = j < P
        tl.store(src_rows + h * P + j, tl.where(miss, src, -1), mask=out)
        tl.store(dst_slots + h * P + j, tl.where(miss, new, 0), mask=out)
        tl.store(rows + h * P + j, tl.where(ok, new * page_size, -1), mask=out)
        c = counters + h * 3
        tl.store(c, tl.load(c) + tl.sum(hit.to(tl.int64), 0))
        tl.store(c + 1, tl.load(c + 1) + tl.sum(miss.to(tl.int64), 0))
        tl.store(c + 2, tl.load(c + 2) + tl.sum(((j < n) & (pg >= n_pages)).to(tl.int64), 0))


def plan_triton(st: PlanState, layer: int, pages: torch.Tensor) -> None:
    """The plan of ``pages [Hkv, n]`` (contiguous int64) of ``layer``: one launch, grid ``(Hkv,)``."""
    heads, n = pages.shape
    p = st.rows.shape[2]
    n_pages = st.host_rows.shape[2]
    warps = PLAN_CONFIG["num_warps"] or (8 if st.scratch.shape[2] >= 1024 else 4)
    _plan_kernel[(heads,)](pages, n, st.page_to_slot[layer], st.slot_to_page[layer], st.stamp[layer],
                           st.clock[layer], st.counters[layer], st.host_rows[layer], st.src_rows[layer],
                           st.dst_slots[layer], st.rows[layer], st.scratch[layer], n_pages, st.slots_per_head,
                           p, st.page_size, BLOCK_P=_next_pow2(p), BLOCK_S=st.scratch.shape[2],
                           KEY_MAX=_KEY_MAX, num_warps=warps)


def plan_torch(st: PlanState, layer: int, pages: torch.Tensor) -> None:
    """``plan_triton`` in torch ops (fixed shapes, no sync): the CPU path and the reference."""
    heads, n = pages.shape
    s, n_pages = st.slots_per_head, st.host_rows.shape[2]
    p2s, s2p, stamp = st.page_to_slot[layer], st.slot_to_page[layer], st.stamp[layer]
    pg = pages.to(torch.int64)
    ok = (pg >= 0) & (pg < n_pages)
    col = torch.where(ok, pg, n_pages)  # padding reads / writes the scratch column
    slot = p2s.gather(1, col)
    hit, miss = ok & (slot >= 0), ok & (slot < 0)
    clock = st.clock[layer]
    clock += 1
    t = clock.unsqueeze(1).expand(heads, n)
    base = torch.arange(heads, device=pg.device).unsqueeze(1) * s
    stamp.scatter_(1, torch.where(hit, slot - base, s), t)
    key = stamp[:, :s] * s + torch.arange(s, device=pg.device)
    victims = key.topk(n, dim=1, largest=False, sorted=True).indices
    vic = victims.gather(1, (miss.cumsum(1) - 1).clamp(min=0))
    at = torch.where(miss, vic, s)
    old = s2p.gather(1, at)
    p2s.scatter_(1, torch.where(miss & (old >= 0), old, n_pages), -1)
    p2s.scatter_(1, torch.where(miss, col, n_pages), vic + base)
    s2p.scatter_(1, at, pg)
    stamp.scatter_(1, at, t)
    new = torch.where(miss, vic + base, slot)
    src = torch.where(miss, st.host_rows[layer].gather(1, col.clamp(max=n_pages - 1)), -1)
    p = st.rows.shape[2]
    for buf, val, pad in ((st.src_rows, src, -1), (st.dst_slots, torch.where(miss, new, 0), 0),
                          (st.rows, torch.where(ok, new * st.page_size, -1), -1)):
        view = buf[layer].view(heads, p)
        view[:, :n] = val
        if n < p:
            view[:, n:] = pad
    bad = (pg >= n_pages).sum(1)
    st.counters[layer] += torch.stack([hit.sum(1), miss.sum(1), bad], dim=1)
