"""The embedded KV store: page files on disk + manifests and artifacts in a metadata backend."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from store.artifacts import digest
from store.capacity import EvictionResult, LeaseHandle, default_holder
from store.config import StoreConfig
from store.errors import CorruptData, InvalidInput, LockTimeout, PrefixNotFound, StoreUnavailable
from store.layout import KVLayout
from store.manifest import ArtifactInfo, FileInfo, Manifest
from store.metadata import MetadataBackend, open_metadata
from store.pages import (
    bytes_digest,
    file_digest,
    layer_file_name,
    pack_layer,
    page_crc,
    read_pages_into,
    unpack_pages,
    write_bytes_durably,
)
from store.prefix_key import PrefixKey

PAGE_CRC_ARTIFACT = "page_crc"
MAX_PENDING_LAYERS = 2
"""Layers a prefix writer may hold in flight (memory bound: each is one layer's page-file bytes)."""
TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PrefixWriter:
    """Writes one prefix into a private temp dir; ``commit`` makes it visible atomically."""

    def __init__(self, store: KVStore, key: PrefixKey, *, model_name: str, n_tokens: int, tenant: str):
        self.store, self.key, self.model_name, self.n_tokens, self.tenant = store, key, model_name, n_tokens, tenant
        self.prefix_id = key.prefix_id
        self.layout: KVLayout = key.layout
        self.tmp_dir = store.prefixes_dir / f"{TMP_PREFIX}{self.prefix_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp_dir.mkdir(parents=True)
        self._files: dict[int, FileInfo] = {}
        self._artifacts: dict[str, bytes] = {}
        n_pages = self.layout.n_pages(n_tokens)
        self._crc = np.zeros((self.layout.n_layers, self.layout.n_kv_heads, n_pages), dtype=np.uint32)
        threads = store.config.write_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstash-write") if threads > 0 else None
        self._pending: list[tuple[int, str, int, Future, list[Future]]] = []

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K and V, each ``[kv_heads, n_tokens, head_dim]``."""
        lay = self.layout
        expect = (lay.n_kv_heads, self.n_tokens, lay.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise InvalidInput(f"layer {layer}: K/V must be {expect}, got {tuple(k.shape)}, {tuple(v.shape)}")
        self.write_layer_pages(layer, pack_layer(lay, k.detach().cpu(), v.detach().cpu()).numpy())

    def write_layer_pages(self, layer: int, arr: np.ndarray) -> None:
        """Store one layer already laid out as page-file bytes ``uint8 [kv_heads, n_pages, page_bytes]``.

        Checksums and the durable write may run in the background until ``commit``: ``arr`` must not
        change until then; a failure raises from a later ``write_layer_pages`` or from ``commit``."""
        lay = self.layout
        expect = (lay.n_kv_heads, lay.n_pages(self.n_tokens), lay.page_bytes)
        if arr.dtype != np.uint8 or tuple(arr.shape) != expect:
            raise InvalidInput(f"layer {layer}: pages must be uint8 {expect}, got {arr.dtype} {tuple(arr.shape)}")
        if not 0 <= layer < lay.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {lay.n_layers})")
        name = layer_file_name(layer)
        # Bounded pipeline: at most MAX_PENDING_LAYERS layers' bytes are held while being written.
        self._drain(MAX_PENDING_LAYERS - 1)
        digest_job = self._run(functools.partial(bytes_digest, arr))
        other_jobs = [self._run(functools.partial(write_bytes_durably, self.tmp_dir / name, arr,
                                                  self.store.config.fsync)),
                      *(self._run(functools.partial(self._page_crcs, layer, arr, h)) for h in range(lay.n_kv_heads))]
        self._pending.append((layer, name, arr.nbytes, digest_job, other_jobs))

    def _run(self, job: Callable[[], object]) -> Future:
        """``job`` on the writer's threads, or now on this one when it has none."""
        if self._pool is not None:
            return self._pool.submit(job)
        done: Future = Future()
        done.set_result(job())
        return done

    def _page_crcs(self, layer: int, arr: np.ndarray, head: int) -> None:
        for p in range(arr.shape[1]):
            self._crc[layer, head, p] = page_crc(self.prefix_id, layer, head, p, memoryview(arr[head, p]))

    def _drain(self, keep: int) -> None:
        """Wait for pending layer writes until at most ``keep`` remain; the first failure raises."""
        while len(self._pending) > keep:
            layer, name, size, digest_job, other_jobs = self._pending.pop(0)
            for f in other_jobs:
                f.result()
            self._files[layer] = FileInfo(name=name, size=size, blake2b=str(digest_job.result()))

    def put_artifact(self, name: str, data: bytes) -> None:
        """Stage a small artifact (committed together with the manifest)."""
        if not name or name == PAGE_CRC_ARTIFACT:
            raise InvalidInput(f"invalid artifact name {name!r}")
        self._artifacts[name] = data

    def commit(self) -> Manifest:
        """Make the prefix durable and visible: pages renamed into place, then the manifest."""
        self._drain(0)
        self._shutdown()
        missing = sorted(set(range(self.layout.n_layers)) - set(self._files))
        if missing:
            raise InvalidInput(f"cannot commit: layers {missing} were not written")
        arts = dict(self._artifacts)
        arts[PAGE_CRC_ARTIFACT] = self._crc.tobytes()
        final = self.store.prefix_dir(self.prefix_id)
        if final.exists():  # left over by a crash before its manifest was committed
            shutil.rmtree(final)
        os.rename(self.tmp_dir, final)
        if self.store.config.fsync:
            _fsync_dir(self.store.prefixes_dir)
        manifest = Manifest(
            prefix_id=self.prefix_id, key=self.key, model_name=self.model_name, n_tokens=self.n_tokens,
            files=tuple(self._files[i] for i in range(self.layout.n_layers)),
            artifacts=tuple(ArtifactInfo(name=n, size=len(b), blake2b=digest(b)) for n, b in sorted(arts.items())),
            created_at=time.time(), tenant=self.tenant,
        )
        self.store.meta.commit(manifest, arts)
        return manifest

    def abort(self) -> None:
        """Discard everything written so far."""
        for *_, digest_job, other_jobs in self._pending:
            for f in (digest_job, *other_jobs):
                f.cancel()
        self._shutdown()  # running writes finish before their files are removed
        self._pending.clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class KVStore:
    """Embedded store: prefixes in ``home/prefixes/<id>/``; metadata in ``home/meta`` (LMDB) or the
    backend ``config.metadata_url`` names (e.g. Redis, shared by several hosts)."""

    def __init__(self, config: StoreConfig | None = None, meta: MetadataBackend | None = None):
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
        self.meta = meta or open_metadata(self.config.metadata_url, home, lmdb_map_size=self.config.lmdb_map_size,
                                          namespace=self.config.metadata_namespace)
        self.collect_garbage()

    # -- paths and locks ---------------------------------------------------------------------
    def prefix_dir(self, prefix_id: str) -> Path:
        """Directory of a prefix's page files."""
        return self.prefixes_dir / prefix_id

    @contextlib.contextmanager
    def prefix_lock(self, prefix_id: str, blocking: bool = True) -> Iterator[bool]:
        """Exclusive per-prefix lock across processes of this host; yields whether it was taken."""
        fd = os.open(self.locks_dir / f"{prefix_id}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *, wait_s: float | None = None) -> Iterator[None]:
        """Single flight for writing or removing a prefix: the metadata backend's lock (across hosts with
        Redis), then this host's ``prefix_lock`` (which garbage collection respects). LockTimeout after
        ``wait_s``."""
        with self.meta.prefill_lock(prefix_id, ttl_s, wait_s=wait_s), self.prefix_lock(prefix_id):
            yield

    def collect_garbage(self) -> list[str]:
        """Remove temp dirs of dead writers and page dirs that have no manifest; returns what went."""
        removed = []
        for entry in self.prefixes_dir.iterdir():
            pid = entry.name[len(TMP_PREFIX):].split("-")[0] if entry.name.startswith(TMP_PREFIX) else entry.name
            with self.prefix_lock(pid, blocking=False) as taken:
                if not taken:
                    continue  # a live writer owns it
                if entry.name.startswith(TMP_PREFIX) or self.meta.manifest(pid) is None:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry.name)
        return removed

    # -- writes --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def write_prefix(self, key: PrefixKey, *, model_name: str, n_tokens: int,
                     tenant: str = "default") -> Iterator[PrefixWriter]:
        """A writer for ``key``; aborted (nothing visible) unless ``commit`` was called."""
        if n_tokens <= 0:
            raise InvalidInput("a prefix needs at least one token")
        writer = PrefixWriter(self, key, model_name=model_name, n_tokens=n_tokens, tenant=tenant)
        try:
            yield writer
        finally:
            writer.abort()  # no-op after a commit: the temp dir was renamed away

    # -- reads ---------------------------------------------------------------------------------
    def manifest(self, prefix_id: str) -> Manifest:
        """The committed manifest of ``prefix_id``; PrefixNotFound otherwise."""
        m = self.meta.manifest(prefix_id)
        if m is None:
            raise PrefixNotFound(f"no prefix {prefix_id!r}")
        return m

    def exists(self, prefix_id: str) -> bool:
        """Whether a committed prefix with that id exists."""
        return self.meta.manifest(prefix_id) is not None

    def list_prefixes(self) -> list[Manifest]:
        """Committed prefixes, newest first."""
        return sorted(self.meta.manifests(), key=lambda m: m.created_at, reverse=True)

    def remove(self, prefix_id: str) -> None:
        """Delete a prefix: manifest first (so it is never half-visible), then its files."""
        with self.prefill_lock(prefix_id):
            if not self.meta.delete(prefix_id):
                raise PrefixNotFound(f"no prefix {prefix_id!r}")
            shutil.rmtree(self.prefix_dir(prefix_id), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.locks_dir / f"{prefix_id}.lock").unlink()

    # -- leases and eviction -----------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, prefix_id: str, *, holder: str | None = None, ttl_s: float = 60.0) -> Iterator[LeaseHandle]:
        """Hold a lease (the prefix cannot be evicted) and mark it used; PrefixNotFound if not committed."""
        handle = LeaseHandle(self.meta, prefix_id, holder or default_holder(), ttl_s)
        try:
            self.meta.touch(prefix_id)
            yield handle
        finally:
            handle.release()

    def evict_to(self, max_bytes: int) -> EvictionResult:
        """Remove least recently used prefixes, never pinned or leased ones, until usage <= ``max_bytes``."""
        if max_bytes < 0:
            raise InvalidInput(f"max_bytes must be >= 0, got {max_bytes}")
        evicted: list[str] = []
        freed = 0
        for _ in range(3):  # candidates can vanish or get leased under us: retry a few rounds
            need = self.meta.usage() - max_bytes
            gone = [(pid, n) for pid in self.meta.eviction_candidates(need) if (n := self._evict_one(pid))]
            evicted += [pid for pid, _ in gone]
            freed += sum(n for _, n in gone)
            if need <= 0 or not gone:
                break
        usage = self.meta.usage()
        return EvictionResult(evicted=tuple(evicted), freed_bytes=freed, usage_bytes=usage,
                              satisfied=usage <= max_bytes)

    def _evict_one(self, prefix_id: str) -> int:
        """Evict one prefix (metadata, then page files); its bytes, or 0 when it is busy, pinned or leased."""
        try:
            with self.prefill_lock(prefix_id, wait_s=0):
                info = self.meta.prefix_usage(prefix_id)
                if info is None or not self.meta.evict(prefix_id):
                    return 0
                shutil.rmtree(self.prefix_dir(prefix_id), ignore_errors=True)
        except LockTimeout:
            return 0
        with contextlib.suppress(FileNotFoundError):
            (self.locks_dir / f"{prefix_id}.lock").unlink()
        return info.bytes

    def artifact(self, prefix_id: str, name: str) -> bytes:
        """An artifact's bytes, checked against the manifest's digest."""
        info = self.manifest(prefix_id).artifact(name)
        data = self.meta.artifact(prefix_id, name)
        if info is None or data is None:
            raise PrefixNotFound(f"prefix {prefix_id!r} has no artifact {name!r}")
        if len(data) != info.size or digest(data) != info.blake2b:
            raise CorruptData(f"artifact {name!r} of prefix {prefix_id} failed its checksum")
        return data

    def page_crcs(self, prefix_id: str, manifest: Manifest | None = None) -> np.ndarray:
        """Per-page keyed CRCs ``[layers, kv_heads, pages]``."""
        m = manifest or self.manifest(prefix_id)
        shape = (m.layout.n_layers, m.layout.n_kv_heads, m.layout.n_pages(m.n_tokens))
        return np.frombuffer(self.artifact(prefix_id, PAGE_CRC_ARTIFACT), dtype=np.uint32).reshape(shape)

    def read_pages(self, prefix_id: str, layer: int, head: int, pages: list[int], out: torch.Tensor, *,
                   verify: bool = False, manifest: Manifest | None = None, crcs: np.ndarray | None = None) -> None:
        """Read pages (sorted, unique ids) of one (layer, head) into ``out`` uint8 ``[n, page_bytes]``.

        ``crcs`` (from ``page_crcs``) saves re-reading the checksum artifact when one caller verifies many reads.
        """
        m = manifest or self.manifest(prefix_id)
        n_pages = m.layout.n_pages(m.n_tokens)
        if pages and (pages[0] < 0 or pages[-1] >= n_pages):
            raise InvalidInput(f"page ids must be in [0, {n_pages}), got {pages[0]}..{pages[-1]}")
        path = self.prefix_dir(prefix_id) / layer_file_name(layer)
        try:
            read_pages_into(path, m.layout, m.n_tokens, head, pages, out)
        except FileNotFoundError as e:
            raise CorruptData(f"page file {path.name} of prefix {prefix_id} is missing") from e
        if verify:
            expected = (crcs if crcs is not None else self.page_crcs(prefix_id, m))[layer, head]
            arr = out.numpy()
            for i, p in enumerate(pages):
                if page_crc(prefix_id, layer, head, p, memoryview(arr[i])) != expected[p]:
                    raise CorruptData(f"prefix {prefix_id}: layer {layer} head {head} page {p} failed its "
                                      "checksum")

    def read_layer(self, prefix_id: str, layer: int, *, verify: bool = False,
                   manifest: Manifest | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K and V, each ``[kv_heads, n_tokens, head_dim]``."""
        m = manifest or self.manifest(prefix_id)
        lay = m.layout
        n_pages = lay.n_pages(m.n_tokens)
        raw = torch.empty(lay.n_kv_heads, n_pages, lay.page_bytes, dtype=torch.uint8)
        crcs = self.page_crcs(prefix_id, m) if verify else None
        for h in range(lay.n_kv_heads):
            self.read_pages(prefix_id, layer, h, list(range(n_pages)), raw[h], verify=verify, manifest=m, crcs=crcs)
        k, v = unpack_pages(lay, raw)  # [h, pages, P, d]
        n = m.n_tokens
        return k.reshape(lay.n_kv_heads, -1, lay.head_dim)[:, :n], v.reshape(lay.n_kv_heads, -1, lay.head_dim)[:, :n]

    def verify(self, prefix_id: str) -> None:
        """Check every page file's size and digest and every artifact; raises CorruptData."""
        m = self.manifest(prefix_id)
        for f in m.files:
            path = self.prefix_dir(prefix_id) / f.name
            if not path.exists() or path.stat().st_size != f.size:
                raise CorruptData(f"page file {f.name} of prefix {prefix_id} is missing or has the wrong size")
            if file_digest(path) != f.blake2b:
                raise CorruptData(f"page file {f.name} of prefix {prefix_id} failed its checksum")
        for a in m.artifacts:
            self.artifact(prefix_id, a.name)

    def close(self) -> None:
        """Release the metadata backend."""
        self.meta.close()
