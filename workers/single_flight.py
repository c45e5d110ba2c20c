"""One build at a time per key within a process: concurrent requests for the same key wait for the first one."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class SingleFlight:
    """Per-key locks that exist only while a request holds or waits for them (thread-safe)."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}
        """Per key being built: its lock and how many requests hold or wait for it."""
        self._guard = threading.Lock()

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold ``key``'s lock (waiting while another request holds it)."""
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:  # the last one out drops the entry: one per build in flight, not per key ever built
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def in_flight(self) -> int:
        """Keys held or waited for now."""
        with self._guard:
            return len(self._locks)
