"""The pinned host tier: warm pages of open prefixes, exact LRU under a byte budget.

One per worker, shared by its generations (thread-safe), keyed by (prefix id, layer, head, page).
Pages enter only after the SSD read that brought them passed its checks, so a hit is served as is.
GPU kernels read the tier's pages directly (mapped pinned memory); before the CPU overwrites a slot
it waits for the last such read of every fetcher (``note_reader``). ``hold`` pins a prefix's slots
against eviction (e.g. for ``DevicePageCache``, whose GPU-side tables point at them for a whole
generation); a held prefix cannot be dropped. A CPU generation's ``HostPageView`` also keeps its extra
entries (Double-P's centroids) in slots under a namespace only it knows, held until it drops them.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from store.layout import KVLayout
from workers.offload.config import OffloadConfig
from workers.offload.lru import CapacityError, SlotLRU, SlotsHeld
from workers.offload.memory import HostBuffer, pin_default


class PrefixHeld(RuntimeError):
    """``drop_prefix`` of a prefix whose pages an open generation holds."""


class HostTier:
    """``budget_bytes // page_bytes`` page slots of host memory (pinned on CUDA machines)."""

    def __init__(self, *, page_bytes: int, budget_bytes: int, pin: bool | None = None):
        if page_bytes <= 0 or budget_bytes < 0:
            raise ValueError("page_bytes must be positive and budget_bytes >= 0")
        self.page_bytes = page_bytes
        self.n_slots = budget_bytes // page_bytes
        self._buf = HostBuffer(self.n_slots * page_bytes, pin=pin_default(pin)) if self.n_slots else None
        empty = torch.zeros(0, page_bytes, dtype=torch.uint8)
        self.pages = self._buf.tensor.view(self.n_slots, page_bytes) if self._buf else empty
        """``[n_slots, page_bytes]`` uint8: the slots (kernels read rows of it)."""
        self._rows = self.pages.numpy()
        self.lru = SlotLRU(self.n_slots)
        self._ns: dict[str, int] = {}
        self._next_ns = 0
        self.lock = threading.RLock()
        self._readers: dict[int, Any] = {}

    @classmethod
    def from_config(cls, layout: KVLayout, config: OffloadConfig) -> HostTier | None:
        """A worker's tier for prefixes of ``layout`` (None when ``host_cache_bytes`` holds no page)."""
        if config.host_cache_bytes < layout.page_bytes:
            return None
        return cls(page_bytes=layout.page_bytes, budget_bytes=config.host_cache_bytes, pin=config.pin_memory)

    @property
    def pinned(self) -> bool:
        """Whether the slots are page-locked (GPU-readable)."""
        return bool(self._buf and self._buf.pinned)

    @property
    def budget_bytes(self) -> int:
        """Bytes of page slots."""
        return self.n_slots * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding a page."""
        return self.lru.used * self.page_bytes

    def open_prefix(self, prefix_id: str, n_keys: int) -> None:
        """Make room in the key space for a prefix of ``n_keys`` pages (idempotent)."""
        with self.lock:
            if prefix_id not in self._ns:
                self._ns[prefix_id] = self._next_ns
                self._next_ns += 1
            self.lru.add_namespace(self._ns[prefix_id], n_keys)

    def drop_prefix(self, prefix_id: str) -> int:
        """Forget a prefix's pages (e.g. the prefix was removed); returns how many slots it freed.

        Raises ``PrefixHeld`` (nothing dropped) while a ``hold`` on its pages is active.
        """
        with self.lock:
            ns = self._ns.get(prefix_id)
            if ns is None:
                return 0
            try:
                freed = self.lru.drop_namespace(ns)
            except SlotsHeld as e:
                raise PrefixHeld(f"prefix {prefix_id} has pages held by an open generation") from e
            del self._ns[prefix_id]
            return freed

    def hold(self, prefix_id: str, keys: np.ndarray) -> np.ndarray | None:
        """Slots of ``keys``, protected from eviction until ``release``; None (nothing held) when the
        prefix is not open or any key is absent."""
        with self.lock:
            ns = self._ns.get(prefix_id)
            if ns is None:
                return None
            slots = self.lru.lookup(ns, keys)
            if slots.size and slots.min() < 0:
                return None
            self.lru.hold(slots)
            return slots

    def release(self, slots: np.ndarray) -> None:
        """Undo one ``hold`` (the caller's GPU reads of these slots must have finished)."""
        with self.lock:
            self.lru.release(slots)

    def begin_batch(self) -> None:
        """Start one fetch: slots it looks up or inserts are not evicted until the next."""
        self.lru.begin_batch()

    def lookup(self, prefix_id: str, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (-1: absent); hits are touched."""
        slots = self.lru.lookup(self._ns[prefix_id], keys)
        self.lru.touch(slots[slots >= 0])
        return slots

    def insert(self, prefix_id: str, keys: np.ndarray, src: np.ndarray) -> np.ndarray | None:
        """Copy pages ``src[i]`` of ``keys[i]`` into slots (LRU eviction); their slots, or None when the
        pages do not fit beside those of the current batch (the caller then serves them from staging)."""
        ns = self._ns[prefix_id]
        slots = self.lru.lookup(ns, keys)
        new = slots < 0
        if not new.any():
            self.lru.touch(slots)
            return slots
        try:
            alloc = self.lru.allocate(ns, keys[new])
        except CapacityError:
            return None
        self.lru.touch(slots[~new])
        self.wait_readers()
        self._rows[alloc.slots] = src if alloc.slots.size == src.shape[0] else src[new]  # all new: one copy
        slots[new] = alloc.slots
        return slots

    def note_reader(self, owner: int, event: Any) -> None:
        """Record the last GPU read of ``owner`` (a CUDA event) from these slots."""
        self._readers[owner] = event

    def forget_reader(self, owner: int) -> None:
        """``owner`` reads no more."""
        self._readers.pop(owner, None)

    def wait_readers(self) -> None:
        """Block until every recorded GPU read has finished (before slots are overwritten)."""
        for event in list(self._readers.values()):
            event.synchronize()

    def close(self) -> None:
        """Unpin the slots."""
        if self._buf is not None:
            self._buf.close()
