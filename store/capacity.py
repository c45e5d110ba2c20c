"""Leases that keep a prefix in use from being evicted, and the result of making room."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from store.metadata import MetadataBackend


def default_holder() -> str:
    """Who holds a lease, for operators: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaseHandle:
    """A held lease on one prefix. Call ``keepalive`` from long loops (e.g. once per decode step):
    it renews the lease once a third of its TTL has passed, and re-acquires one that lapsed
    (PrefixNotFound if the prefix was evicted meanwhile)."""

    def __init__(self, meta: MetadataBackend, prefix_id: str, holder: str, ttl_s: float) -> None:
        self.prefix_id, self.holder, self.ttl_s = prefix_id, holder, ttl_s
        self._meta = meta
        self.lease_id = meta.acquire_lease(prefix_id, holder, ttl_s)
        self._renewed_at = time.monotonic()

    def keepalive(self) -> None:
        """Renew when due; cheap (no I/O) otherwise."""
        if time.monotonic() - self._renewed_at < self.ttl_s / 3:
            return
        if not self._meta.renew_lease(self.lease_id, self.ttl_s):
            self.lease_id = self._meta.acquire_lease(self.prefix_id, self.holder, self.ttl_s)
        self._renewed_at = time.monotonic()

    def release(self) -> bool:
        """End the lease; False when it had already lapsed."""
        return self._meta.release_lease(self.lease_id)


@dataclass(frozen=True, kw_only=True)
class EvictionResult:
    """What ``KVStore.evict_to`` did. Not reaching the target is a result, not an error."""

    evicted: tuple[str, ...]
    """Prefix ids removed, least recently used first."""
    freed_bytes: int
    usage_bytes: int
    """Total accounted bytes afterwards."""
    satisfied: bool
    """Whether usage is now at or under the target (False when pins and leases hold too much)."""
