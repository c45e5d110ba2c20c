"""LMDB metadata backend: everything in one environment, one write transaction per change.

Commits are written without a sync, and the changes that must survive a power loss (a manifest, a
deletion, a pin) sync the environment right after their commit. Leases and last-used times do not: they
are taken and dropped on every generation, and an fsync each (milliseconds) was most of the time a short
request spent outside its decode steps. A system crash may lose those, or damage the environment if
the disk reordered its writes; a damaged environment is moved aside and rebuilt from the prefix
directories at the next open, and leases lapse anyway.

Sub-databases: ``manifests`` (pid -> manifest JSON), ``lru`` (pid -> last used, bytes), ``pins``, ``leases``.
No artifact bytes: an environment written before artifacts left the metadata has an ``artifacts``
sub-database, which opening drops (``LEGACY_ARTIFACTS_DB``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import struct
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import lmdb

from store.errors import KVStashError, PrefixInUse, PrefixNotFound, StoreFull, StoreUnavailable
from store.lmdb_file import lmdb_damage, move_aside
from store.locks import file_lock
from store.manifest import Manifest
from store.metadata import (
    DEFAULT_LMDB_MAP_SIZE,
    Lease,
    MetadataBackend,
    PrefixUsage,
    check_ttl,
    new_lease_id,
    prefix_bytes,
)

_LRU = struct.Struct("<dq")  # last_used (unix s), bytes
_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
           lmdb.IncompatibleError, lmdb.PanicError)
"""What opening, or first reading, a damaged environment raises."""


FULL_DISK_BYTES = 1 << 20
"""Free bytes under which a failed LMDB write is put down to a full disk."""
LEGACY_ARTIFACTS_DB = b"artifacts"
"""Where artifact bytes were kept before they became files of the prefix directory only; dropped at open."""

log = logging.getLogger(__name__)


class LmdbMetadata(MetadataBackend):
    """Everything in one LMDB environment; leases use wall-clock time, prefill locks are flocks."""

    def __init__(self, path: Path, map_size: int = DEFAULT_LMDB_MAP_SIZE, lock_dir: Path | None = None) -> None:
        """Open (or create) the environment in directory ``path``. A damaged one (truncated, not LMDB, failing
        its first reads) is moved aside and a new, empty one created: the store registers its prefixes again
        from their directories."""
        self._lock_dir = lock_dir or path / "locks"
        self._path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # One process at a time decides whether the environment is damaged and moves it aside.
            with file_lock(path.parent / f".{path.name}.open.lock"):
                if (why := lmdb_damage(path)) is not None:
                    move_aside(path, why)
                try:
                    self._open(path, map_size)
                except _DAMAGE as e:
                    with contextlib.suppress(lmdb.Error, AttributeError):
                        self._env.close()
                    move_aside(path, f"{type(e).__name__}: {e}")
                    self._open(path, map_size)
        except (OSError, lmdb.Error) as e:
            raise StoreUnavailable(f"cannot open metadata store at {path}: {e}") from e
        self._backfill_lru()
        self._drop_legacy_artifacts()

    def _open(self, path: Path, map_size: int) -> None:
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=8, subdir=True, sync=False)
        self._manifests = self._env.open_db(b"manifests")
        self._lru = self._env.open_db(b"lru")
        self._pins = self._env.open_db(b"pins")
        self._leases = self._env.open_db(b"leases")
        with self._env.begin() as txn:  # walk the registry's keys once: a damaged tree fails here, not later
            for db in (self._manifests, self._lru, self._pins, self._leases):
                txn.stat(db)
            for _ in txn.cursor(db=self._manifests).iternext(keys=True, values=False):
                pass

    @contextlib.contextmanager
    def _txn(self, write: bool = False, durable: bool = True) -> Iterator[lmdb.Transaction]:
        """A transaction; a ``durable`` write is on disk when this returns (a volatile one is in the OS cache)."""
        try:
            with self._env.begin(write=write) as txn:
                yield txn
            if write and durable:
                self._env.sync(True)
        except lmdb.Error as e:
            if write and (isinstance(e, lmdb.MapFullError) or self._disk_full()):
                raise StoreFull(f"metadata store could not commit: no space left ({e})") from e
            raise StoreUnavailable(f"metadata store failed: {e}") from e

    def _disk_full(self) -> bool:
        """Whether the disk under the environment is (nearly) out of space: LMDB reports a write that found no
        room as an I/O error."""
        try:
            return shutil.disk_usage(self._path).free < FULL_DISK_BYTES
        except OSError:
            return False

    def _backfill_lru(self) -> None:
        """Give manifests committed before LRU accounting existed an entry (last used = created)."""
        with self._txn() as txn:
            if txn.stat(self._manifests)["entries"] == txn.stat(self._lru)["entries"]:
                return
        with self._txn(write=True) as txn:
            for k, v in txn.cursor(db=self._manifests):
                if txn.get(k, db=self._lru) is None:
                    m = Manifest.from_json(bytes(v))
                    txn.put(k, _LRU.pack(m.created_at, prefix_bytes(m)), db=self._lru)

    def _drop_legacy_artifacts(self) -> None:
        """Drop the artifact bytes an older kvstash kept here (their files in the prefix directories are the
        copy read now); a failure is logged, not raised: the bytes are merely unused."""
        with self._txn() as txn:  # named databases are keys of the main one: a read finds it
            if txn.get(LEGACY_ARTIFACTS_DB) is None:
                return
        try:
            with self._txn(write=True) as txn:
                try:
                    db = self._env.open_db(LEGACY_ARTIFACTS_DB, txn=txn, create=False)
                except lmdb.NotFoundError:
                    return
                n = txn.stat(db)["entries"]
                txn.drop(db, delete=True)
        except KVStashError as e:
            log.warning("could not drop the unused artifact copies of %s: %s", self._path, e)
            return
        log.info("dropped %d artifact copies kept by an older kvstash in %s (artifacts are read from the prefix "
                 "directories)", n, self._path)

    # -- registry ------------------------------------------------------------------------
    def commit(self, manifest: Manifest) -> None:
        """Write manifest and LRU entry in one transaction: both visible or neither."""
        pid = manifest.prefix_id
        with self._txn(write=True) as txn:
            txn.put(pid.encode(), manifest.to_json().encode(), db=self._manifests)
            txn.put(pid.encode(), _LRU.pack(time.time(), prefix_bytes(manifest)), db=self._lru)

    def manifest(self, prefix_id: str) -> Manifest | None:
        """The committed manifest, or None."""
        with self._txn() as txn:
            raw = txn.get(prefix_id.encode(), db=self._manifests)
        return None if raw is None else Manifest.from_json(bytes(raw))

    def manifests(self) -> list[Manifest]:
        """Every committed manifest."""
        with self._txn() as txn:
            return [Manifest.from_json(bytes(v)) for _, v in txn.cursor(db=self._manifests)]

    def prefix_ids(self) -> list[str]:
        """The ids of every committed prefix."""
        with self._txn() as txn:
            return [bytes(k).decode() for k in txn.cursor(db=self._manifests).iternext(keys=True, values=False)]

    def _delete_range(self, txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes) -> None:
        cur = txn.cursor(db=db)
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                if not cur.delete():
                    break

    def _delete_all(self, txn: lmdb.Transaction, prefix_id: str) -> bool:
        key = prefix_id.encode()
        existed = txn.delete(key, db=self._manifests)
        txn.delete(key, db=self._lru)
        txn.delete(key, db=self._pins)
        self._delete_range(txn, self._leases, f"{prefix_id}.".encode())
        return bool(existed)

    def delete(self, prefix_id: str, *, unless_leased: bool = False) -> bool:
        """Remove manifest, LRU entry, pin and leases in one transaction (none while leased, when
        ``unless_leased``: ``PrefixInUse``)."""
        with self._txn(write=True) as txn:
            if unless_leased and (live := self._live_leases(txn, prefix_id, time.time())):
                raise PrefixInUse(f"prefix {prefix_id} is in use: {len(live)} live lease(s)")
            return self._delete_all(txn, prefix_id)

    # -- leases --------------------------------------------------------------------------
    def _scan_leases(self, txn: lmdb.Transaction, prefix_id: str) -> list[tuple[bytes, dict]]:
        prefix, out = f"{prefix_id}.".encode(), []
        cur = txn.cursor(db=self._leases)
        if cur.set_range(prefix):
            for k, v in cur:
                if not bytes(k).startswith(prefix):
                    break
                out.append((bytes(k), json.loads(bytes(v))))
        return out

    def _live_leases(self, txn: lmdb.Transaction, prefix_id: str, now: float) -> list[Lease]:
        return [Lease(lease_id=k.decode(), prefix_id=prefix_id, holder=d["holder"], expires_at=d["expires_at"])
                for k, d in self._scan_leases(txn, prefix_id) if d["expires_at"] > now]

    def _put_lease(self, txn: lmdb.Transaction, lease_id: str, holder: str, expires_at: float) -> None:
        txn.put(lease_id.encode(), json.dumps({"holder": holder, "expires_at": expires_at}).encode(),
                db=self._leases)

    def acquire_lease(self, prefix_id: str, holder: str, ttl_s: float) -> str:
        """Lease a committed prefix (expired leases of it are dropped on the way)."""
        ttl_s, now = check_ttl(ttl_s), time.time()
        with self._txn(write=True, durable=False) as txn:
            if txn.get(prefix_id.encode(), db=self._manifests) is None:
                raise PrefixNotFound(f"no prefix {prefix_id!r}")
            for k, d in self._scan_leases(txn, prefix_id):
                if d["expires_at"] <= now:
                    txn.delete(k, db=self._leases)
            lease_id = new_lease_id(prefix_id)
            self._put_lease(txn, lease_id, holder, now + ttl_s)
        return lease_id

    def _take_lease(self, txn: lmdb.Transaction, lease_id: str, now: float) -> dict | None:
        raw = txn.pop(lease_id.encode(), db=self._leases)
        if raw is None:
            return None
        d = json.loads(bytes(raw))
        return d if d["expires_at"] > now else None

    def renew_lease(self, lease_id: str, ttl_s: float) -> bool:
        """Extend a live lease; a lapsed one is dropped and stays lapsed."""
        ttl_s, now = check_ttl(ttl_s), time.time()
        with self._txn(write=True, durable=False) as txn:
            d = self._take_lease(txn, lease_id, now)
            if d is not None:
                self._put_lease(txn, lease_id, d["holder"], now + ttl_s)
        return d is not None

    def release_lease(self, lease_id: str) -> bool:
        """End a lease; False when it had already lapsed or is unknown."""
        with self._txn(write=True, durable=False) as txn:
            return self._take_lease(txn, lease_id, time.time()) is not None

    def leases(self, prefix_id: str) -> list[Lease]:
        """The live leases of a prefix."""
        with self._txn() as txn:
            return self._live_leases(txn, prefix_id, time.time())

    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *,
                     wait_s: float | None = None) -> AbstractContextManager[None]:
        """An flock in ``lock_dir`` (one host; the kernel drops it when its holder dies, so the TTL is moot)."""
        check_ttl(ttl_s)
        return file_lock(self._lock_dir / f"{prefix_id}.prefill", wait_s)

    # -- LRU, pins, eviction -------------------------------------------------------------
    def touch(self, prefix_id: str) -> bool:
        """Mark a prefix as just used."""
        key = prefix_id.encode()
        with self._txn(write=True, durable=False) as txn:
            raw = txn.get(key, db=self._lru)
            if raw is None:
                return False
            txn.put(key, _LRU.pack(time.time(), _LRU.unpack(raw)[1]), db=self._lru)
        return True

    def usage(self) -> int:
        """Total bytes of every committed prefix."""
        with self._txn() as txn:
            return sum(_LRU.unpack(v)[1] for _, v in txn.cursor(db=self._lru))

    def prefix_usage(self, prefix_id: str) -> PrefixUsage | None:
        """Accounting of one prefix."""
        key = prefix_id.encode()
        with self._txn() as txn:
            raw = txn.get(key, db=self._lru)
            if raw is None:
                return None
            last_used, size = _LRU.unpack(raw)
            return PrefixUsage(prefix_id=prefix_id, bytes=size, last_used=last_used,
                               pinned=txn.get(key, db=self._pins) is not None,
                               leases=len(self._live_leases(txn, prefix_id, time.time())))

    def eviction_candidates(self, bytes_needed: int) -> list[str]:
        """LRU first, skipping pinned and leased prefixes, until ``bytes_needed`` is covered."""
        out: list[str] = []
        got, now = 0, time.time()
        with self._txn() as txn:
            entries = sorted((*_LRU.unpack(v), bytes(k).decode()) for k, v in txn.cursor(db=self._lru))
            for _, size, pid in entries:
                if got >= bytes_needed:
                    break
                if txn.get(pid.encode(), db=self._pins) is None and not self._live_leases(txn, pid, now):
                    out.append(pid)
                    got += size
        return out

    def evict(self, prefix_id: str) -> bool:
        """Delete the prefix unless it is pinned or leased, in one transaction."""
        with self._txn(write=True) as txn:
            key = prefix_id.encode()
            if (txn.get(key, db=self._manifests) is None or txn.get(key, db=self._pins) is not None
                    or self._live_leases(txn, prefix_id, time.time())):
                return False
            return self._delete_all(txn, prefix_id)

    def pin(self, prefix_id: str) -> None:
        """Exempt a committed prefix from eviction."""
        with self._txn(write=True) as txn:
            if txn.get(prefix_id.encode(), db=self._manifests) is None:
                raise PrefixNotFound(f"no prefix {prefix_id!r}")
            txn.put(prefix_id.encode(), b"1", db=self._pins)

    def unpin(self, prefix_id: str) -> bool:
        """Make a prefix evictable again."""
        with self._txn(write=True) as txn:
            return bool(txn.delete(prefix_id.encode(), db=self._pins))

    def close(self) -> None:
        """Close the environment."""
        self._env.close()
