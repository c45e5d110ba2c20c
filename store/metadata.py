"""The metadata backend base: manifests, leases, pins and LRU accounting (an index: artifacts are files in the
prefix directory, ``store.disk_record``, never kept here).

LMDB (``store.lmdb_metadata``) is the embedded default; ``store.redis_metadata`` shares metadata
between hosts; ``store.metadata_factory.open_metadata`` picks one by URL scheme. Backends import this
module, never the reverse. Both run ``tests/test_metadata_contract.py``.
"""

from __future__ import annotations

import abc
import secrets
from contextlib import AbstractContextManager
from dataclasses import dataclass

from store.errors import InvalidInput
from store.manifest import Manifest

DEFAULT_NAMESPACE = "kvstash:"
DEFAULT_LMDB_MAP_SIZE = 1 << 36


@dataclass(frozen=True, kw_only=True)
class Lease:
    """A live lease: while it lasts, eviction never removes its prefix."""

    lease_id: str
    prefix_id: str
    holder: str
    expires_at: float
    """Unix time (seconds) at which the lease lapses unless renewed."""


@dataclass(frozen=True, kw_only=True)
class PrefixUsage:
    """Accounting of one committed prefix."""

    prefix_id: str
    bytes: int
    """Page files plus artifacts, as listed in the manifest."""
    last_used: float
    """Unix time of the commit or the latest ``touch``."""
    pinned: bool
    leases: int
    """Live leases right now."""


def prefix_bytes(manifest: Manifest) -> int:
    """The bytes a prefix accounts for: its page files and its artifacts."""
    return manifest.kv_bytes + manifest.artifact_bytes


def new_lease_id(prefix_id: str) -> str:
    """A fresh lease id; it names its prefix so that ``release_lease`` needs nothing else."""
    return f"{prefix_id}.{secrets.token_hex(8)}"


def lease_prefix(lease_id: str) -> str | None:
    """The prefix id inside a lease id, or None when the id is malformed."""
    pid, sep, token = lease_id.rpartition(".")
    return pid if sep and pid and token else None


def check_ttl(ttl_s: float) -> float:
    """Validate a TTL in seconds."""
    if not 0 < ttl_s <= 86400:
        raise InvalidInput(f"ttl_s must be in (0, 86400] seconds, got {ttl_s}")
    return float(ttl_s)


class MetadataBackend(abc.ABC):
    """Where manifests, leases, pins and LRU state live (no artifact bytes: a manifest lists its artifacts' names,
    sizes and digests; their bytes are files in the prefix directory).

    A commit is atomic and durable. Eviction (``evict``) never removes a pinned prefix
    or one with a live lease; ``delete`` is the explicit removal and always proceeds.
    """

    @abc.abstractmethod
    def commit(self, manifest: Manifest) -> None:
        """Atomically make a prefix's manifest visible, with its LRU entry and byte count (replacing an older
        commit of the same prefix)."""

    @abc.abstractmethod
    def manifest(self, prefix_id: str) -> Manifest | None:
        """The committed manifest, or None."""

    @abc.abstractmethod
    def manifests(self) -> list[Manifest]:
        """Every committed manifest."""

    @abc.abstractmethod
    def prefix_ids(self) -> list[str]:
        """The ids of every committed prefix (cheaper than ``manifests``: no manifest is read)."""

    @abc.abstractmethod
    def delete(self, prefix_id: str, *, unless_leased: bool = False) -> bool:
        """Remove a prefix's manifest, accounting, pin and leases; False when it did not exist. With
        ``unless_leased``, ``PrefixInUse`` instead when it has a live lease (checked atomically with the delete)."""

    @abc.abstractmethod
    def acquire_lease(self, prefix_id: str, holder: str, ttl_s: float) -> str:
        """Lease a committed prefix for ``ttl_s`` seconds; returns the lease id. PrefixNotFound otherwise."""

    @abc.abstractmethod
    def renew_lease(self, lease_id: str, ttl_s: float) -> bool:
        """Extend a live lease to ``ttl_s`` from now; False when it already lapsed or is unknown."""

    @abc.abstractmethod
    def release_lease(self, lease_id: str) -> bool:
        """End a lease; False when it had already lapsed or is unknown."""

    @abc.abstractmethod
    def leases(self, prefix_id: str) -> list[Lease]:
        """The live leases of a prefix."""

    @abc.abstractmethod
    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *,
                     wait_s: float | None = None) -> AbstractContextManager[None]:
        """Single-flight lock for writing ``prefix_id``: one holder at a time across every process sharing
        this backend. A crashed holder releases it (Redis: after ``ttl_s``; it is renewed while held).
        Waits at most ``wait_s`` (forever when None), then raises LockTimeout."""

    @abc.abstractmethod
    def touch(self, prefix_id: str) -> bool:
        """Mark a prefix as just used (LRU); False when it is not committed."""

    @abc.abstractmethod
    def usage(self) -> int:
        """Total bytes of every committed prefix."""

    @abc.abstractmethod
    def prefix_usage(self, prefix_id: str) -> PrefixUsage | None:
        """Accounting of one prefix, or None when it is not committed."""

    @abc.abstractmethod
    def eviction_candidates(self, bytes_needed: int) -> list[str]:
        """Least recently used first, skipping pinned and leased prefixes, until their bytes
        reach ``bytes_needed`` (fewer when not enough can go)."""

    @abc.abstractmethod
    def evict(self, prefix_id: str) -> bool:
        """Delete the prefix unless it is pinned or leased (checked atomically with the delete)."""

    @abc.abstractmethod
    def pin(self, prefix_id: str) -> None:
        """Exempt a committed prefix from eviction; PrefixNotFound otherwise."""

    @abc.abstractmethod
    def unpin(self, prefix_id: str) -> bool:
        """Make a prefix evictable again; False when it was not pinned."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources."""
