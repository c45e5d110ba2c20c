"""Torch reference of the page plan (~20 torch ops, fixed shapes, no sync): the CPU path and the oracle."""

from __future__ import annotations

import torch

from .state import PlanState

__all__ = ["plan_pages_ref"]


def plan_pages_ref(st: PlanState, layer: int, pages: torch.Tensor) -> None:
    """The plan of ``pages [Hkv, n]`` (int64) of ``layer`` into ``st`` (semantics: ``ops.plan_pages``)."""
    heads, n = pages.shape
    s, n_pages = st.slots_per_head, st.n_pages
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
    w = st.window(n)
    start = ((clock - 1) * w) % s  # the window rotates by its width each plan
    idx = (start.unsqueeze(1) + torch.arange(w, device=pg.device)) % s
    key = stamp.gather(1, idx) * s + idx
    victims = idx.gather(1, key.topk(n, dim=1, largest=False, sorted=True).indices)
    vic = victims.gather(1, (miss.cumsum(1) - 1).clamp(min=0))
    at = torch.where(miss, vic, s)
    old = s2p.gather(1, at)
    p2s.scatter_(1, torch.where(miss & (old >= 0), old, n_pages), -1)
    p2s.scatter_(1, torch.where(miss, col, n_pages), vic + base)
    s2p.scatter_(1, at, pg)
    stamp.scatter_(1, at, t)
    new = torch.where(miss, vic + base, slot)
    src = torch.where(miss, st.host_rows[layer].gather(1, col.clamp(max=n_pages - 1)), -1)
    st.src_rows[layer, : heads * n] = src.reshape(-1)
    st.dst_slots[layer, : heads * n] = torch.where(miss, new, 0).reshape(-1)
    st.rows[layer, :, :n] = torch.where(ok, new * st.page_size, -1)
    bad = (pg >= n_pages).sum(1)
    st.counters[layer] += torch.stack([hit.sum(1), miss.sum(1), bad], dim=1)
