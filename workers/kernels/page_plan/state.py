"""The device tables a page plan reads and updates: every layer's map, owners, stamps, clocks and outputs.

Per layer (head ``h`` owns the global slots ``[h * S, (h + 1) * S)``, so heads never share a slot and one
program per head plans without races):

- ``page_to_slot [L, Hkv, n_pages + 1]`` int64: global slot of a resident page, -1 elsewhere;
- ``slot_to_page [L, Hkv, S + 1]`` int64: page in a slot (local index), -1 when empty;
- ``stamp [L, Hkv, S + 1]`` int64: fetch number of the slot's last use (0: never used);
- ``clock [L, Hkv]`` int64: fetches of the layer so far; ``counters [L, Hkv, 3]``: hits, misses,
  rejected ids (>= n_pages);
- the last column of each table is scratch for the torch path's masked scatters (never meaningful).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import next_pow2

__all__ = ["PlanState", "WINDOW_MIN"]

WINDOW_MIN = 256
"""Fewest slots per head a plan searches for victims (all of them when the head has fewer)."""


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
    """``[L, Hkv * P]`` int64 outputs (see ``ops.plan_pages``)."""
    dst_slots: torch.Tensor
    rows: torch.Tensor
    """``[L, Hkv, P]`` int64."""
    scratch: torch.Tensor
    """``[L, Hkv, BLOCK_S]`` int64: the sorted victims of the Triton path."""
    slots_per_head: int
    page_size: int
    window_min: int = WINDOW_MIN
    """Fewest slots a plan searches for victims (see ``window``)."""

    def window(self, n: int) -> int:
        """Slots a plan of ``n`` pages per head searches for its victims: a rotating window of at least twice
        ``n`` (never all of a large cache: sorting every slot's stamp cost more than the rest of a sparse
        step), all slots when the head has no more than that."""
        return min(self.slots_per_head, max(self.window_min, next_pow2(2 * n)))

    @classmethod
    def empty(cls, *, host_rows: torch.Tensor, slots_per_head: int, pages_per_call: int, page_size: int,
              window_min: int = WINDOW_MIN) -> PlanState:
        """Empty tables for ``host_rows [L, Hkv, n_pages]`` (on the cache's device)."""
        n_layers, heads, n_pages = host_rows.shape
        s, p, dev = slots_per_head, pages_per_call, host_rows.device

        def full(*shape: int, value: int = -1) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=dev)

        return cls(page_to_slot=full(n_layers, heads, n_pages + 1), slot_to_page=full(n_layers, heads, s + 1),
                   stamp=full(n_layers, heads, s + 1, value=0), clock=full(n_layers, heads, value=0),
                   counters=full(n_layers, heads, 3, value=0), host_rows=host_rows.to(torch.int64),
                   src_rows=full(n_layers, heads * p), dst_slots=full(n_layers, heads * p, value=0),
                   rows=full(n_layers, heads, p), scratch=full(n_layers, heads, next_pow2(s), value=0),
                   slots_per_head=s, page_size=page_size, window_min=window_min)

    @property
    def pages_per_call(self) -> int:
        """P, the most page ids per KV head of one plan."""
        return self.rows.shape[2]

    @property
    def n_pages(self) -> int:
        """Pages per KV head and layer."""
        return self.host_rows.shape[2]
