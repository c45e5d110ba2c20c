"""An exact, vectorized LRU over fixed-size slots (numpy), shared by the GPU page cache and the host tier.

Keys live in *namespaces* (a prefix in the host tier; one generation's layer in the GPU cache), each
with a dense table key -> slot (-1: absent), so a step's lookups are one fancy-index. Work is done
in *batches* (one fetch call): ``begin_batch`` advances the clock, ``touch`` stamps the slots a
batch uses, and ``allocate`` never evicts a slot stamped in the current batch.

Allocation order (exact, tests rely on it): never-used slots in ascending order; then empty slots
(released by ``drop``) and least recently stamped slots, by (stamp, slot) ascending. Slots ``hold``
pinned (a reference count) are never evicted or dropped until released.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class CapacityError(Exception):
    """More slots were needed in one batch than exist outside the batch's own (and the held ones)."""


class SlotsHeld(Exception):
    """A namespace whose slots are held was asked to be dropped."""


@dataclass(frozen=True)
class Allocation:
    """Slots given to new keys, and the keys evicted to make room (their namespaces)."""

    slots: np.ndarray
    evicted_ns: np.ndarray
    evicted_keys: np.ndarray


class SlotLRU:
    """Exact LRU of ``n_slots`` slots; see the module docstring for the allocation order."""

    def __init__(self, n_slots: int):
        if n_slots < 0:
            raise ValueError(f"n_slots must be >= 0, got {n_slots}")
        self.n_slots = n_slots
        self.stamp = np.zeros(n_slots, dtype=np.int64)  # 0: empty
        self.owner_ns = np.full(n_slots, -1, dtype=np.int64)
        self.owner_key = np.full(n_slots, -1, dtype=np.int64)
        self.holds = np.zeros(n_slots, dtype=np.int64)  # > 0: never evicted (see ``hold``)
        self.tables: dict[int, np.ndarray] = {}
        self.tick = 0
        self.high = 0  # slots >= high were never used
        self.evictions = 0
        self.used = 0

    def begin_batch(self) -> None:
        """Start a batch: slots touched from now on are protected from eviction until the next."""
        self.tick += 1

    def add_namespace(self, ns: int, n_keys: int) -> None:
        """Register a namespace of keys ``[0, n_keys)`` (no-op when it exists with that size)."""
        table = self.tables.get(ns)
        if table is not None and table.shape[0] != n_keys:
            raise ValueError(f"namespace {ns} exists with {table.shape[0]} keys, not {n_keys}")
        if table is None:
            self.tables[ns] = np.full(n_keys, -1, dtype=np.int64)

    def drop_namespace(self, ns: int) -> int:
        """Forget a namespace and empty its slots; returns how many slots it held.

        Raises SlotsHeld (and drops nothing) while any of its slots is held.
        """
        table = self.tables.get(ns)
        if table is None:
            return 0
        slots = table[table >= 0]
        if (self.holds[slots] > 0).any():
            raise SlotsHeld(f"namespace {ns} has held slots; release them first")
        del self.tables[ns]
        self.stamp[slots] = 0
        self.owner_ns[slots] = -1
        self.owner_key[slots] = -1
        self.used -= int(slots.size)
        return int(slots.size)

    def lookup(self, ns: int, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (-1 where absent); does not touch."""
        return self.tables[ns][keys]

    def touch(self, slots: np.ndarray) -> None:
        """Mark slots as used by the current batch."""
        self.stamp[slots] = self.tick

    def hold(self, slots: np.ndarray) -> None:
        """Protect occupied ``slots`` from eviction until ``release`` (reference counted)."""
        np.add.at(self.holds, slots, 1)

    def release(self, slots: np.ndarray) -> None:
        """Undo one ``hold`` of ``slots``."""
        if (self.holds[slots] <= 0).any():
            raise ValueError("release of a slot that is not held")
        np.add.at(self.holds, slots, -1)

    def allocate(self, ns: int, keys: np.ndarray) -> Allocation:
        """Slots for ``keys`` (absent from ``ns``), touched; evicts least recently used slots.

        Raises CapacityError when fewer slots than ``len(keys)`` lie outside the current batch.
        """
        n = int(keys.shape[0])
        fresh = min(n, self.n_slots - self.high)
        slots = np.arange(self.high, self.high + fresh, dtype=np.int64)
        ev_ns = ev_keys = np.zeros(0, dtype=np.int64)
        if n > fresh:
            victims = self._victims(n - fresh)  # among slots used before: never the fresh ones
            occupied = victims[self.owner_ns[victims] >= 0]
            ev_ns, ev_keys = self.owner_ns[occupied], self.owner_key[occupied]
            if ev_ns.size and (ev_ns == ev_ns[0]).all():  # one namespace (the GPU cache): no grouping
                self.tables[int(ev_ns[0])][ev_keys] = -1
            else:
                for o in np.unique(ev_ns).tolist():
                    self.tables[o][ev_keys[ev_ns == o]] = -1
            self.evictions += int(occupied.size)
            self.used -= int(occupied.size)
            slots = np.concatenate([slots, victims])
        self.high += fresh
        self.tables[ns][keys] = slots
        self.owner_ns[slots] = ns
        self.owner_key[slots] = keys
        self.stamp[slots] = self.tick
        self.used += n
        return Allocation(slots, ev_ns, ev_keys)

    def _victims(self, n: int) -> np.ndarray:
        """The ``n`` used-before slots with the smallest (stamp, slot) outside the current batch and
        not held."""
        seen = self.stamp[: self.high]
        busy = (seen >= self.tick) | (self.holds[: self.high] > 0)
        free = self.high - int(busy.sum())
        if free < n:
            raise CapacityError(f"need {n} slots outside the current batch and the held ones, {free} exist "
                                f"of {self.n_slots}")
        order = seen * self.high + np.arange(self.high, dtype=np.int64)
        order[busy] = np.iinfo(np.int64).max
        pick = np.argpartition(order, n - 1)[:n] if n < self.high else np.arange(self.high)
        return pick[np.argsort(order[pick], kind="stable")].astype(np.int64)
