"""The embedded KV store: self-describing prefix directories on disk, indexed by a metadata backend.

``KVStore`` is the one interface to stored prefixes: code outside ``store/`` never touches the
metadata backend (``tests/test_store_boundary.py``). Every method that takes a prefix id from a
caller checks its form first (``check_prefix_id``), so no id reaches a path or a metadata key unchecked.
The disk is the truth: each committed directory holds its manifest and artifacts (``store.disk_record``;
artifacts are read from there, the metadata keeps none), and opening a store registers the ones its
metadata lost (``store.recovery``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from store import disk_record, recovery
from store.added_artifact import StagedArtifact
from store.artifacts import ArtifactData
from store.background_sync import BackgroundSync
from store.capacity import EvictionResult, LeaseHandle, default_holder
from store.config import StoreConfig
from store.disk_record import ArtifactRead
from store.errors import (
    CorruptData,
    InvalidInput,
    KVStashError,
    LockTimeout,
    PrefixNotFound,
    QuotaExceeded,
    StoreFull,
    StoreUnavailable,
)
from store.layout import KVLayout
from store.limits import MAX_ARTIFACTS, check_holder, check_text, check_write, max_added_artifact_bytes
from store.locks import file_lock, try_file_lock
from store.manifest import PAGE_CRC_ARTIFACT, ArtifactInfo, Manifest
from store.metadata import Lease, MetadataBackend, PrefixUsage, lease_prefix, prefix_bytes
from store.metadata_factory import open_metadata
from store.page_files_check import page_files_problem
from store.page_io import PageCheck, PosixPageReader, read_checked
from store.pages import unpack_pages
from store.pinned_pool import PinnedPool
from store.prefix_key import PrefixKey, check_prefix_id, tenant_salt
from store.recovery import CheckReport, Problem
from store.writer import PrefixWriter, tmp_dir_name

QUOTA_LOCK_WAIT_S = 60.0
"""Longest a commit waits for another commit of the same tenant to pass its quota check."""

if TYPE_CHECKING:  # torch is imported by the reads that make tensors: ls, rm and check stay light
    import torch

__all__ = ["KVStore", "PrefixWriter", "PAGE_CRC_ARTIFACT", "Lease", "PrefixUsage", "EvictionResult", "LeaseHandle",
           "CheckReport", "Problem"]

log = logging.getLogger(__name__)


def read_only_u32(data: bytearray, shape: tuple[int, ...]) -> np.ndarray:
    """``data`` as a read-only uint32 array of ``shape`` (a view: the page CRCs callers share)."""
    a = np.frombuffer(data, dtype=np.uint32).reshape(shape)
    a.flags.writeable = False
    return a


def _owned(m: Manifest, tenant: str, secret: str | None) -> bool:
    """The tenant-visibility rule: the prefix was committed for ``tenant`` (and, when the caller's salt
    secret is given, its key carries the salt that secret gives ``tenant``).

    Every step runs whatever the outcome (constant-time compares, no short cut), so a prefix of another
    tenant costs what a missing one does (``KVStore.visible``).
    """
    expected_salt = tenant_salt(tenant, secret or "")
    same_tenant = hmac.compare_digest(m.tenant.encode(), tenant.encode())
    same_salt = hmac.compare_digest(m.key.tenant_salt.encode(), expected_salt.encode())
    return same_tenant & (secret is None or same_salt)


_ABSENT_JSON = Manifest(prefix_id="0" * 32, model_name="", n_tokens=1, tenant="", files=(),
                        key=PrefixKey(model_fingerprint="", tenant_salt="", token_hash="",
                                      layout=KVLayout(n_layers=1, n_kv_heads=1, head_dim=1, dtype="float16"))).to_json()
"""What ``visible`` parses and checks on a miss, so a miss does the work a hit on another tenant's id does."""


class KVStore:
    """Embedded store: prefixes in ``home/prefixes/<id>/``; metadata in ``home/meta`` (LMDB) or the
    backend ``config.metadata_url`` names (e.g. Redis, shared by several hosts)."""

    def __init__(self, config: StoreConfig | None = None, meta: MetadataBackend | None = None, *,
                 recover: bool = True):
        """Open the store; unless told not to, ``recover`` what its metadata lost from the prefix directories."""
        self.config = config or StoreConfig()
        home = self.config.home.expanduser()
        self.prefixes_dir = home / "prefixes"
        self.locks_dir = home / "locks"
        try:
            self.prefixes_dir.mkdir(parents=True, exist_ok=True)
            self.locks_dir.mkdir(parents=True, exist_ok=True)
            probe = home / f".probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreUnavailable(f"data directory {home} is not usable: {e.strerror or e}") from e
        self._meta = meta or open_metadata(self.config.metadata_url, home, lmdb_map_size=self.config.lmdb_map_size,
                                           namespace=self.config.metadata_namespace)
        self._staging: PinnedPool | None = None
        self._staging_lock = threading.Lock()
        self._syncer = BackgroundSync(self.prefixes_dir)
        if recover:
            self.recover()

    # -- paths and locks ---------------------------------------------------------------------
    def prefix_dir(self, prefix_id: str) -> Path:
        """Directory of a prefix's page files."""
        return self.prefixes_dir / check_prefix_id(prefix_id)

    @contextlib.contextmanager
    def prefix_lock(self, prefix_id: str, blocking: bool = True) -> Iterator[bool]:
        """Exclusive per-prefix lock across processes of this host; yields whether it was taken."""
        with self._host_lock(check_prefix_id(prefix_id), blocking) as taken:
            yield taken

    @contextlib.contextmanager
    def _host_lock(self, name: str, blocking: bool) -> Iterator[bool]:
        path = self.locks_dir / f"{name}.lock"
        if not blocking:
            with try_file_lock(path) as taken:
                yield taken
            return
        with file_lock(path):
            yield True

    @contextlib.contextmanager
    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *, wait_s: float | None = None) -> Iterator[None]:
        """Single flight for writing or removing a prefix: the metadata backend's lock (across hosts with
        Redis), then this host's ``prefix_lock`` (which garbage collection respects). LockTimeout after
        ``wait_s``."""
        check_prefix_id(prefix_id)
        with self._meta.prefill_lock(prefix_id, ttl_s, wait_s=wait_s), self.prefix_lock(prefix_id):
            yield

    def recover(self) -> CheckReport:
        """What opening the store does: remove temp dirs of dead writers and register every committed directory
        the metadata does not know (after Redis lost its data, or LMDB was rebuilt); report the rest.

        Cheap for many prefixes: directories the metadata knows are not read, page files are only stat'ed.
        Deletes no prefix directory, valid or not (``check(repair=True)`` removes orphans): temp dirs only.
        """
        return recovery.recover(self)

    def check(self, repair: bool = False, *, hash_pages: bool = True) -> CheckReport:
        """Compare metadata and disk: entries whose files are missing, damaged or not self-describing,
        directories that are no committed prefix (orphans), committed ones the metadata lacks. With
        ``repair``, fix each (register, rewrite, or remove what cannot be used) and say so in the report."""
        return recovery.check(self, repair=repair, hash_pages=hash_pages)

    # -- writes --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def write_prefix(self, key: PrefixKey, *, model_name: str, n_tokens: int,
                     tenant: str = "default") -> Iterator[PrefixWriter]:
        """A writer for ``key``; aborted (nothing visible) unless ``commit`` was called. InvalidInput for
        sizes out of the store's bounds, QuotaExceeded (or StoreFull) when it would not fit: both before
        anything is allocated or created."""
        if n_tokens <= 0:
            raise InvalidInput("a prefix needs at least one token")
        self._check_room(tenant, check_write(key, n_tokens, model_name))
        writer = PrefixWriter(self, key, model_name=model_name, n_tokens=n_tokens, tenant=tenant)
        try:
            yield writer
        finally:
            writer.abort()  # no-op after a commit: the temp dir was renamed away

    def staging_pool(self) -> PinnedPool | None:
        """The pinned buffers prefills stage device layers in, shared by this store's writers (made at the first
        use); None when ``config.pinned_staging_bytes`` is 0 (each writer allocates its own)."""
        if self.config.pinned_staging_bytes == 0:
            return None
        with self._staging_lock:
            if self._staging is None:
                self._staging = PinnedPool(self.config.pinned_staging_bytes)
            return self._staging

    def sync_later(self, directory: Path, marker: str) -> None:
        """Make a just-committed directory durable in the background (``StoreConfig.sync_after_commit``)."""
        self._syncer.schedule(directory, marker)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every prefix committed so far is on the disk; whether all were within ``timeout``."""
        return self._syncer.flush(timeout)

    def unsynced(self) -> int:
        """Committed prefixes of this store object not yet on the disk (being fsync'd in the background)."""
        return self._syncer.pending()

    def _check_room(self, tenant: str, page_bytes: int) -> None:
        """QuotaExceeded when a new prefix of ``page_bytes`` would exceed the capacity or ``tenant``'s quotas;
        StoreFull when the disk has less free space than that."""
        cfg = self.config
        if cfg.capacity_bytes is not None and page_bytes > cfg.capacity_bytes:
            raise QuotaExceeded(f"a prefix of {page_bytes} bytes exceeds the store's capacity of "
                                f"{cfg.capacity_bytes} bytes")
        free = shutil.disk_usage(self.prefixes_dir).free
        if page_bytes > free:
            raise StoreFull(f"a prefix of {page_bytes} bytes does not fit in the {free} bytes free on disk")
        self._check_tenant_quota(tenant, page_bytes)

    @contextlib.contextmanager
    def quota_guard(self, tenant: str, page_bytes: int) -> Iterator[None]:
        """Held around a commit: ``tenant``'s quotas checked again under a per-tenant lock (the metadata
        backend's, so across processes and hosts), so concurrent writes of one tenant that each passed the
        early check cannot together exceed them. QuotaExceeded before anything becomes visible."""
        with self._quota_lock(tenant) as locked:
            if locked:
                self._check_tenant_quota(tenant, page_bytes)
            yield

    @contextlib.contextmanager
    def _quota_lock(self, tenant: str) -> Iterator[bool]:
        """``tenant``'s quota lock, held while the block runs; yields False (and takes no lock) when the store
        has no per-tenant quota."""
        cfg = self.config
        if cfg.max_bytes_per_tenant is None and cfg.max_prefixes_per_tenant is None:
            yield False
            return
        name = "quota-" + hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()  # no tenant text in a path
        with self._meta.prefill_lock(name, wait_s=QUOTA_LOCK_WAIT_S):
            yield True

    def _check_tenant_quota(self, tenant: str, page_bytes: int, *, new_prefix: bool = True) -> None:
        """QuotaExceeded when ``page_bytes`` more (and, with ``new_prefix``, one more prefix) would take ``tenant``
        over its quotas; an artifact added to a prefix the tenant has counts bytes only."""
        cfg = self.config
        if cfg.max_bytes_per_tenant is None and cfg.max_prefixes_per_tenant is None:
            return
        mine = self._tenant_manifests(tenant)
        if new_prefix and cfg.max_prefixes_per_tenant is not None and len(mine) >= cfg.max_prefixes_per_tenant:
            raise QuotaExceeded(f"tenant {tenant!r} stores {len(mine)} prefixes, its quota is "
                                f"{cfg.max_prefixes_per_tenant}")
        self._check_tenant_bytes(tenant, sum(prefix_bytes(m) for m in mine), page_bytes)

    def _tenant_manifests(self, tenant: str) -> list[Manifest]:
        # A scan of the registry: quotas are checked once per write, which is far costlier anyway.
        return [m for m in self._meta.manifests() if m.tenant == tenant]

    def _tenant_bytes(self, tenant: str) -> int:
        """Bytes ``tenant``'s prefixes take (page files and artifacts)."""
        return sum(prefix_bytes(m) for m in self._tenant_manifests(tenant))

    def _check_tenant_bytes(self, tenant: str, used: int, more: int) -> None:
        """QuotaExceeded when ``more`` bytes beside the ``used`` ones would exceed ``tenant``'s byte quota."""
        cap = self.config.max_bytes_per_tenant
        if cap is not None and used + more > cap:
            raise QuotaExceeded(f"tenant {tenant!r} stores {used} bytes; {more} more exceed its quota of {cap}")

    def _commit(self, manifest: Manifest) -> None:
        """Register a written prefix (``PrefixWriter.commit``, once its directory is in place), then evict down
        to the capacity, never the prefix just committed."""
        self._meta.commit(manifest)
        cap = self.config.capacity_bytes
        if cap is None:
            return
        try:
            result = self._evict_to(cap, keep=manifest.prefix_id)
        except KVStashError as e:  # the commit stands; the next one evicts again
            log.warning("eviction to the capacity of %d bytes failed: %s", cap, e)
            return
        if not result.satisfied:
            log.warning("store holds %d bytes, over its capacity of %d: the rest is pinned, leased or busy",
                        result.usage_bytes, cap)

    def add_artifact(self, prefix_id: str, name: str, data: ArtifactData) -> Manifest:
        """Add an artifact to a committed prefix (a compressed cache built after the prefill); returns the
        manifest that lists it. ``data`` is its bytes, or an iterable of its chunks, each written to a staged file
        as it is pulled (memory holds one chunk; pulled while the prefix's prefill lock is held). The size cap
        (``max_added_artifact_bytes``) and the tenant's byte quota are checked before each chunk is written: a
        refusal, or a failure (the iterable's own included), leaves no file and changes nothing.

        First writer wins: when ``name`` is already committed (another worker got there first), nothing is
        pulled or written and the committed manifest is returned. The artifact's file goes into the prefix
        directory, then the directory's manifest is replaced, then the metadata's, all under the prefix's
        prefill lock, so a removal or eviction never sees half of it."""
        check_text("artifact name", name)
        if not name or name == PAGE_CRC_ARTIFACT:
            raise InvalidInput(f"invalid artifact name {name!r}")
        with self.prefill_lock(prefix_id):
            m = self.manifest(prefix_id)
            if m.artifact(name) is not None:
                return m
            if len(m.artifacts) + 1 > MAX_ARTIFACTS:
                raise InvalidInput(f"a prefix holds at most {MAX_ARTIFACTS} artifacts")
            with StagedArtifact(self.prefixes_dir, prefix_id, name, fsync=self.config.fsync,
                                check_room=self._added_room(m, name)) as staged:
                return self._commit_added(m, staged, staged.write_all(data))

    def _added_room(self, m: Manifest, name: str) -> Callable[[int], None]:
        """A check that an artifact ``name`` of ``size`` bytes still fits beside ``m``'s: InvalidInput past the
        prefix's cap, QuotaExceeded past its tenant's byte quota (as of now: ``_commit_added`` checks it again)."""
        cap = max_added_artifact_bytes(m.kv_bytes)
        used = self._tenant_bytes(m.tenant) if self.config.max_bytes_per_tenant is not None else 0

        def check(size: int) -> None:
            if m.artifact_bytes + size > cap:
                raise InvalidInput(f"artifact {name!r} ({size} bytes or more) does not fit: this prefix's artifacts "
                                   f"may take {cap} bytes together and already take {m.artifact_bytes}")
            self._check_tenant_bytes(m.tenant, used, size)
        return check

    def _commit_added(self, m: Manifest, staged: StagedArtifact, info: ArtifactInfo) -> Manifest:
        """Commit a written added artifact (caller holds the prefill lock): its file, the directory's manifest,
        the metadata's, with the byte quota re-checked and used atomically under the tenant's quota lock."""
        # Appended, not sorted in: artifact files are named by manifest position, the old ones keep theirs.
        new = dataclasses.replace(m, artifacts=(*m.artifacts, info))
        d = self.prefix_dir(m.prefix_id)
        path = d / disk_record.artifact_file_name(len(m.artifacts))
        with self._quota_lock(m.tenant):
            self._check_tenant_quota(m.tenant, info.size, new_prefix=False)
            staged.move_to(path)
            try:
                disk_record.publish(d, new, fsync=self.config.fsync)
                self._meta.commit(new)
            except BaseException:
                disk_record.publish(d, m, fsync=self.config.fsync)  # the directory says what the index says
                path.unlink(missing_ok=True)
                raise
        return new

    # -- manifests and tenancy -----------------------------------------------------------------
    def find(self, prefix_id: str) -> Manifest | None:
        """The committed manifest of ``prefix_id``, or None."""
        return self._meta.manifest(check_prefix_id(prefix_id))

    def manifest(self, prefix_id: str) -> Manifest:
        """The committed manifest of ``prefix_id``; PrefixNotFound otherwise."""
        m = self.find(prefix_id)
        if m is None:
            raise PrefixNotFound(f"no prefix {prefix_id!r}")
        return m

    def visible(self, prefix_id: str, tenant: str, *, secret: str | None = None) -> Manifest:
        """The manifest of a prefix ``tenant`` may use; PrefixNotFound otherwise.

        Another tenant's prefix raises exactly what a missing one does. With ``secret`` (the caller's
        tenant-salt secret), a prefix whose key was salted under another secret is not visible either.
        """
        m = self.find(prefix_id)
        # One path for a miss and another tenant's prefix (no timing oracle): a manifest is parsed and checked.
        owned = _owned(m if m is not None else Manifest.from_json(_ABSENT_JSON), tenant, secret)
        if m is None or not owned:
            raise PrefixNotFound(f"no prefix {prefix_id!r}")
        return m

    def exists(self, prefix_id: str) -> bool:
        """Whether a committed prefix with that id exists."""
        return self.find(prefix_id) is not None

    def list_prefixes(self, tenant: str | None = None, *, secret: str | None = None) -> list[Manifest]:
        """Committed prefixes (only those ``tenant`` may use, when given, by ``visible``'s rule), newest first."""
        ms = self._meta.manifests()
        if tenant is not None:
            ms = [m for m in ms if _owned(m, tenant, secret)]
        return sorted(ms, key=lambda m: m.created_at, reverse=True)

    def remove(self, prefix_id: str, *, unless_leased: bool = False) -> None:
        """Delete a prefix: its on-disk manifest first (so it can never be registered again), then its
        metadata (so it is never half-visible), then its files. With ``unless_leased``, ``PrefixInUse`` when a
        generation holds a lease on it, checked atomically with the metadata delete (a lease taken after the
        delete finds no prefix), and nothing is removed."""
        with self.prefill_lock(prefix_id):
            m = self._meta.manifest(prefix_id)
            if m is None:
                raise PrefixNotFound(f"no prefix {prefix_id!r}")
            self._unregister(m, unless_leased=unless_leased)
            self._drop_dir(prefix_id)

    def _unregister(self, m: Manifest, *, unless_leased: bool = False) -> None:
        """Remove the on-disk manifest, then the metadata of a prefix (caller holds its prefill lock); the
        on-disk manifest comes back when the metadata delete fails (or is refused: a live lease)."""
        d = self.prefix_dir(m.prefix_id)
        disk_record.unpublish(d, fsync=self.config.fsync)
        try:
            self._meta.delete(m.prefix_id, unless_leased=unless_leased)
        except BaseException:
            if d.is_dir():  # its artifact files are still there
                disk_record.publish(d, m, fsync=self.config.fsync)
            raise

    def _drop_dir(self, prefix_id: str) -> None:
        """Remove a prefix's directory: renamed to a temp name first (atomic; start-up collects it if we die)."""
        d = self.prefix_dir(prefix_id)
        gone = self.prefixes_dir / tmp_dir_name(prefix_id)
        try:
            os.rename(d, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    # -- leases, pins and eviction ---------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, prefix_id: str, *, holder: str | None = None, ttl_s: float = 60.0) -> Iterator[LeaseHandle]:
        """Hold a lease (the prefix cannot be evicted) and mark it used; PrefixNotFound if not committed."""
        handle = LeaseHandle(self._meta, check_prefix_id(prefix_id), check_holder(holder or default_holder()), ttl_s)
        try:
            self._meta.touch(prefix_id)
            yield handle
        finally:
            handle.release()

    def acquire_lease(self, prefix_id: str, holder: str, ttl_s: float) -> str:
        """Lease a committed prefix for ``ttl_s`` seconds (renew by acquiring again); returns the lease id.
        InvalidInput for a holder name over ``store.limits.MAX_HOLDER_BYTES`` bytes."""
        return self._meta.acquire_lease(check_prefix_id(prefix_id), check_holder(holder), ttl_s)

    def release_lease(self, lease_id: str, *, prefix_id: str | None = None) -> bool:
        """End a lease; False when it had already lapsed. InvalidInput for a malformed lease id, or one
        that does not belong to ``prefix_id`` when that is given."""
        owner = lease_prefix(lease_id)
        if owner is None or (prefix_id is not None and owner != prefix_id):
            raise InvalidInput("malformed lease_id" if prefix_id is None else "lease_id does not belong to prefix_id")
        check_prefix_id(owner)
        return self._meta.release_lease(lease_id)

    def leases(self, prefix_id: str) -> list[Lease]:
        """The live leases of a prefix."""
        return self._meta.leases(check_prefix_id(prefix_id))

    def pin(self, prefix_id: str) -> None:
        """Exempt a committed prefix from eviction; PrefixNotFound otherwise."""
        d = self.prefix_dir(check_prefix_id(prefix_id))
        with self.prefill_lock(prefix_id):
            # The marker first: a crash in between leaves it pinned on disk, which recovery honours (the
            # safe side: an operator unpins again; a lost pin could let eviction delete it).
            if d.is_dir():
                disk_record.mark_pinned(d, True, fsync=self.config.fsync)
            try:
                self._meta.pin(prefix_id)
            except BaseException:
                if d.is_dir():
                    disk_record.mark_pinned(d, False, fsync=self.config.fsync)
                raise

    def unpin(self, prefix_id: str) -> bool:
        """Make a prefix evictable again; False when it was not pinned."""
        d = self.prefix_dir(check_prefix_id(prefix_id))
        with self.prefill_lock(prefix_id):
            was = self._meta.unpin(prefix_id)
            marked = d.is_dir() and disk_record.is_marked_pinned(d)
            if marked:
                disk_record.mark_pinned(d, False, fsync=self.config.fsync)
            return was or marked

    def usage_of(self, prefix_id: str) -> PrefixUsage | None:
        """Accounting of one prefix (bytes, last use, pinned, live leases), or None when not committed."""
        return self._meta.prefix_usage(check_prefix_id(prefix_id))

    def usage(self) -> int:
        """Total bytes of every committed prefix."""
        return self._meta.usage()

    def evict_to(self, max_bytes: int) -> EvictionResult:
        """Remove least recently used prefixes, never pinned or leased ones, until usage <= ``max_bytes``."""
        return self._evict_to(max_bytes)

    def _evict_to(self, max_bytes: int, keep: str | None = None) -> EvictionResult:
        if max_bytes < 0:
            raise InvalidInput(f"max_bytes must be >= 0, got {max_bytes}")
        evicted: list[str] = []
        freed = 0
        for _ in range(3):  # candidates can vanish or get leased under us: retry a few rounds
            need = self._meta.usage() - max_bytes
            gone = [(pid, n) for pid in self._meta.eviction_candidates(need)
                    if pid != keep and (n := self._evict_one(pid))]
            evicted += [pid for pid, _ in gone]
            freed += sum(n for _, n in gone)
            if need <= 0 or not gone:
                break
        usage = self._meta.usage()
        return EvictionResult(evicted=tuple(evicted), freed_bytes=freed, usage_bytes=usage,
                              satisfied=usage <= max_bytes)

    def _evict_one(self, prefix_id: str) -> int:
        """Evict one prefix (metadata, then page files); its bytes, or 0 when it is busy, pinned or leased."""
        try:
            with self.prefill_lock(prefix_id, wait_s=0):
                info = self._meta.prefix_usage(prefix_id)
                if info is None or not self._meta.evict(prefix_id):
                    return 0
                # A crash right here brings the prefix back at the next start: harmless for a cache.
                self._drop_dir(prefix_id)
        except LockTimeout:
            return 0
        return info.bytes

    # -- reads ---------------------------------------------------------------------------------
    def artifact(self, prefix_id: str, name: str, *, manifest: Manifest | None = None) -> bytearray:
        """An artifact's bytes, read from its file in the prefix directory and checked against the manifest's
        size and digest (CorruptData otherwise; never more than its size + 1 bytes are read). PrefixNotFound when
        the manifest lists no artifact ``name``."""
        return self.artifact_read(prefix_id, name, manifest=manifest).data()

    def artifact_read(self, prefix_id: str, name: str, *, manifest: Manifest | None = None
                      ) -> ArtifactRead:
        """An artifact being read in the background: its bytes usable as they arrive (unchecked), the whole then
        checked against the manifest (``data()``; CorruptData otherwise, as from any of its calls).
        PrefixNotFound when the manifest lists no artifact ``name``."""
        m = self._read_manifest(prefix_id, manifest)
        read = disk_record.start_artifact_read(self.prefix_dir(prefix_id), m, name,
                                               lambda msg: CorruptData(f"prefix {prefix_id}: {msg}"))
        if read is None:
            raise PrefixNotFound(f"prefix {prefix_id!r} has no artifact {name!r}")
        return read

    def page_crcs(self, prefix_id: str, manifest: Manifest | None = None) -> np.ndarray:
        """Per-page keyed CRCs ``[layers, kv_heads, pages]``."""
        m = self._read_manifest(prefix_id, manifest)
        shape = (m.layout.n_layers, m.layout.n_kv_heads, m.layout.n_pages(m.n_tokens))
        return read_only_u32(self.artifact(prefix_id, PAGE_CRC_ARTIFACT, manifest=m), shape)

    def read_pages(self, prefix_id: str, layer: int, head: int, pages: list[int], out: torch.Tensor, *,
                   verify: bool = False, manifest: Manifest | None = None, crcs: np.ndarray | None = None) -> None:
        """Read pages (sorted, unique ids) of one (layer, head) into ``out`` uint8 ``[n, page_bytes]``.

        ``crcs`` (from ``page_crcs``) saves re-reading the checksum artifact when one caller verifies many reads.
        """
        import torch

        m = self._read_manifest(prefix_id, manifest)
        lay = m.layout
        n_pages = lay.n_pages(m.n_tokens)
        if not (0 <= layer < lay.n_layers and 0 <= head < lay.n_kv_heads):
            raise InvalidInput(f"layer {layer} / kv head {head} out of range [0, {lay.n_layers}) / "
                               f"[0, {lay.n_kv_heads})")
        if pages and (pages[0] < 0 or pages[-1] >= n_pages):
            raise InvalidInput(f"page ids must be in [0, {n_pages}), got {pages[0]}..{pages[-1]}")
        if out.dtype != torch.uint8 or tuple(out.shape) != (len(pages), lay.page_bytes) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous uint8 [{len(pages)}, {lay.page_bytes}], got {out.dtype} "
                             f"{tuple(out.shape)}")
        linear = head * n_pages + np.asarray(pages, dtype=np.int64)
        self._read_layer_file(m, layer, linear, out.numpy(), crcs, verify)

    def read_layer(self, prefix_id: str, layer: int, *, verify: bool = False,
                   manifest: Manifest | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K and V, each ``[kv_heads, n_tokens, head_dim]``."""
        import torch

        m = self._read_manifest(prefix_id, manifest)
        lay = m.layout
        if not 0 <= layer < lay.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {lay.n_layers})")
        n_pages = lay.n_pages(m.n_tokens)
        raw = torch.empty(lay.n_kv_heads, n_pages, lay.page_bytes, dtype=torch.uint8)
        linear = np.arange(lay.n_kv_heads * n_pages, dtype=np.int64)  # the whole file: one run
        self._read_layer_file(m, layer, linear, raw.view(-1, lay.page_bytes).numpy(), None, verify)
        k, v = unpack_pages(lay, raw)  # [h, pages, P, d]
        n = m.n_tokens
        return k.reshape(lay.n_kv_heads, -1, lay.head_dim)[:, :n], v.reshape(lay.n_kv_heads, -1, lay.head_dim)[:, :n]

    def _read_manifest(self, prefix_id: str, manifest: Manifest | None) -> Manifest:
        check_prefix_id(prefix_id)
        if manifest is not None and manifest.prefix_id != prefix_id:
            raise InvalidInput("manifest is not the one of prefix_id")
        return manifest or self.manifest(prefix_id)

    def _read_layer_file(self, m: Manifest, layer: int, linear: np.ndarray, out: np.ndarray,
                         crcs: np.ndarray | None, verify: bool) -> None:
        """Pages ``linear`` (``head * n_pages + page``) of one layer file into ``out``, through the store's one
        coalesced reader; checked against their keyed CRCs when ``verify``."""
        check = None
        if verify:
            table = crcs if crcs is not None else self.page_crcs(m.prefix_id, m)
            check = PageCheck(prefix_id=m.prefix_id, layer=layer, n_pages=m.layout.n_pages(m.n_tokens),
                              crcs=table[layer])
        f = m.files[layer]
        reader = PosixPageReader()
        try:
            read_checked(reader, self.prefix_dir(m.prefix_id) / f.name, f.size, linear, m.layout.page_bytes, out,
                         check)
        finally:
            reader.close()

    def verify(self, prefix_id: str) -> None:
        """Check every page and artifact file's size and bytes (page files by their page CRCs, or their digest in
        manifests written before version 2; artifacts by their digest); raises CorruptData."""
        m = self.manifest(prefix_id)
        d = self.prefix_dir(prefix_id)
        if (bad := disk_record.file_problem(d, m)) is not None:
            raise CorruptData(f"prefix {prefix_id}: {bad}")
        if (bad := page_files_problem(d, m)) is not None:
            raise CorruptData(f"prefix {prefix_id}: {bad}")
        if (bad := disk_record.artifact_problem(d, m)) is not None:
            raise CorruptData(f"prefix {prefix_id}: {bad}")

    def quick_check(self, prefix_id: str, *, artifacts: bool = True) -> str | None:
        """What is wrong with a committed prefix that shows without reading its pages (a page or artifact file
        missing or of the wrong size; with ``artifacts``, an artifact failing its checksum), or None. ``verify``
        reads it all."""
        m = self.manifest(prefix_id)
        d = self.prefix_dir(prefix_id)
        if (bad := disk_record.file_problem(d, m)) is not None:
            return bad
        return disk_record.artifact_problem(d, m) if artifacts else None

    def close(self) -> None:
        """Finish making committed prefixes durable; release the metadata backend and the kept staging buffers."""
        self._syncer.close()
        self._meta.close()
        if self._staging is not None:
            self._staging.clear()
