"""Writing one prefix: page files, artifacts and manifest into a private temp dir, an atomic rename, then
the metadata commit of the manifest (``store.disk_record`` describes the directory)."""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, Self

import numpy as np

from store.artifacts import ArtifactData, as_chunks, new_digest
from store.disk_record import artifact_file_name, fsync_dir, mark_unsynced, publish
from store.errors import InvalidInput, StoreFull
from store.host_copy import HostCopy, copy_to_host
from store.layout import KVLayout
from store.limits import MAX_ARTIFACTS, check_text, max_artifact_bytes
from store.manifest import PAGE_CRC_ARTIFACT, PAGE_CRCS, ArtifactInfo, FileInfo, Manifest
from store.metadata import prefix_bytes
from store.page_crc_native import page_crcs
from store.pages import layer_file_name, pack_layer, write_bytes_durably
from store.pinned_pool import PinnedPool, StagingLease, size_class
from store.prefix_key import PrefixKey

if TYPE_CHECKING:
    import torch

    from store.config import StoreConfig


class WriterHome(Protocol):
    """What a ``PrefixWriter`` needs from its store (``KVStore`` is one): where prefixes live, the
    store's settings, and the metadata commit that makes a prefix visible."""

    config: StoreConfig
    prefixes_dir: Path

    def prefix_dir(self, prefix_id: str) -> Path:
        """The committed directory of ``prefix_id``."""
        ...

    def _commit(self, manifest: Manifest) -> None:
        """Register a prefix whose directory is in place."""
        ...

    def quota_guard(self, tenant: str, page_bytes: int) -> AbstractContextManager[None]:
        """Held around a commit: the tenant's quotas re-checked atomically with it."""
        ...

    def staging_pool(self) -> PinnedPool | None:
        """The pinned buffers shared by the store's writers to stage device layers in; None: each writer its own."""
        ...

    def sync_later(self, directory: Path, marker: str) -> None:
        """Make a just-committed directory (marked unsynced) durable in the background."""
        ...


class ArtifactHome(Protocol):
    """Where an ``ArtifactStream`` goes (a ``PrefixWriter``, or one artifact added to a committed prefix): the
    room it may take, and what happens to it once closed or dropped."""

    def _check_artifact_room(self, stream: ArtifactStream, size: int) -> None:
        """Raise (a typed error) when ``stream`` may not grow to ``size`` bytes."""
        ...

    def _finish_artifact(self, stream: ArtifactStream, info: ArtifactInfo) -> None:
        """Record a closed stream's artifact (its file written and flushed)."""
        ...

    def _drop_artifact(self, stream: ArtifactStream) -> None:
        """Forget a stream whose file was removed."""
        ...


MAX_PENDING_LAYERS = 4
"""Layers a prefix writer may hold in flight (memory bound: each is one layer's page-file bytes). Their page CRCs
(one kernel call per KV head, ``store.page_crc_native``) and durable writes run in parallel. Page files carry no
digest of their whole: their page CRCs cover every byte (``store.manifest.PAGE_CRCS``); a blake2b of a 128k-token
layer (512 MiB at Llama-3.1-8B's shape) took about a second of a core, twice its durable write."""
TMP_PREFIX = ".tmp-"
"""Name prefix of writers' temp dirs (``.tmp-<prefix id>-<pid>-<random>``)."""
MAX_OPEN_STREAMS = 8
"""Layers a streamed write may have open at once (each holds a file and less than one page)."""
STAGED_PREFIX = ".artifact-"
"""Name prefix of artifact files staged in a temp dir (by put order), renamed to ``artifact_NNN.bin`` at commit."""


@dataclass(frozen=True)
class PendingLayer:
    """A layer whose checksums and durable write may still run: they all read its bytes (``lease``'s buffer,
    when it was staged), so the buffer goes back only once every one of its jobs is done."""

    layer: int
    name: str
    size: int
    jobs: list[Future]
    lease: StagingLease | None

    def settle(self) -> None:
        """Wait for every job, a failed one included: then nothing reads the layer's bytes any more."""
        wait(self.jobs)


def _after(copied: HostCopy | None, job: Callable[[], object]) -> Callable[[], object]:
    """``job``, run once the copy of the bytes it reads is complete."""
    if copied is None:
        return job

    def run() -> object:
        copied.wait()
        return job()

    return run


def tmp_dir_name(prefix_id: str) -> str:
    """A fresh temp dir name for ``prefix_id`` (garbage collection reads the id back from it)."""
    return f"{TMP_PREFIX}{prefix_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class PrefixWriter:
    """Writes one prefix into a private temp dir; ``commit`` makes it visible atomically."""

    def __init__(self, store: WriterHome, key: PrefixKey, *, model_name: str, n_tokens: int, tenant: str):
        self.store, self.key, self.model_name, self.n_tokens, self.tenant = store, key, model_name, n_tokens, tenant
        self.prefix_id = key.prefix_id
        self.layout: KVLayout = key.layout
        self._files: dict[int, FileInfo] = {}
        self._artifacts: dict[str, tuple[str, ArtifactInfo]] = {}
        """Staged artifacts: name -> (its file in the temp dir, size and digest). Never their bytes."""
        self._n_staged = 0
        self._artifact_budget = max_artifact_bytes(self.layout.n_layers * self.layout.layer_file_bytes(n_tokens))
        self._sealed = False
        """Set once a commit starts moving artifacts to their final names: no more artifacts or commits."""
        self._streams: dict[int, LayerStream] = {}
        self._artifact_streams: dict[str, ArtifactStream] = {}
        """Artifacts being written (``open_artifact``), not yet recorded."""
        self._claimed: dict[str, int] = {}
        """Bytes each budgeted stream being written may grow to (checked and claimed at once: streams of a prefill's
        summaries write from their own threads)."""
        self._room_lock = threading.Lock()
        n_pages = self.layout.n_pages(n_tokens)
        self._crc = np.zeros((self.layout.n_layers, self.layout.n_kv_heads, n_pages), dtype=np.uint32)
        self._pending: list[PendingLayer] = []
        self._staging: PinnedPool | None = None
        """Where device layers are staged (``_write_staged``): the store's pool, or this writer's own."""
        self._spares: list[StagingLease] = []
        """Pageable buffers of this writer (the pool was full when it staged a layer), free for its next layers."""
        config = store.config
        sync_later = config.fsync and config.sync_after_commit
        self._fsync = config.fsync and not sync_later
        """Whether each file is fsync'd as it is written (else after the commit, or never)."""
        self.tmp_dir = store.prefixes_dir / tmp_dir_name(self.prefix_id)
        self.tmp_dir.mkdir(parents=True)  # last: a failure above leaves nothing on disk
        try:
            self._marker: str | None = mark_unsynced(self.tmp_dir) if sync_later else None
        except BaseException:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise
        """The unsynced marker's token (durable before any other file: a crash can never leave this directory
        committed without it while its files are not on the disk)."""
        threads = store.config.write_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstash-write") if threads > 0 else None

    @property
    def fsyncs_each_file(self) -> bool:
        """Whether each file is fsync'd as it is written (before the commit), not after it or never."""
        return self._fsync

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K and V, each ``[kv_heads, n_tokens, head_dim]``."""
        lay = self.layout
        expect = (lay.n_kv_heads, self.n_tokens, lay.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise InvalidInput(f"layer {layer}: K/V must be {expect}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if k.device.type == "cuda":  # packed where it is, then one copy into pinned memory (a pageable copy of
            # the unpacked K and V, then packing on the host, took 0.5 s of a 128k layer's 512 MiB)
            self._write_staged(layer, pack_layer(lay, k.detach(), v.detach()))
        else:
            self.write_layer_pages(layer, pack_layer(lay, k.detach().cpu(), v.detach().cpu()).numpy())

    def _write_staged(self, layer: int, pages: torch.Tensor) -> None:
        """Write a layer's page bytes (on a device) from a host buffer leased from the staging pool; the buffer
        goes back once every job reading it is done (``PendingLayer.settle``), never earlier."""
        self._check_new_layer(layer)
        self._drain(MAX_PENDING_LAYERS - 1)  # first: a writer leases at most MAX_PENDING_LAYERS buffers
        lease = self._lease_staging(pages.numel())
        copied: HostCopy | None = None
        try:
            buf = lease.view(pages.shape)
            # On a side stream into the pinned buffer: the device goes on with the next layer meanwhile, and the
            # jobs wait for the copy before they read the bytes.
            copied = copy_to_host(pages, buf)
            self._write_pages(layer, buf.numpy(), lease, copied)
        except BaseException:
            if copied is not None:
                copied.wait()  # the copy into the buffer must be over before another layer leases it
            self._hand_back(lease)  # no job reads it: ``_write_pages`` raises only once none runs
            raise

    def _lease_staging(self, nbytes: int) -> StagingLease:
        """A pooled (pinned) buffer, else a spare of this writer's, else a new pageable one: never a wait."""
        lease = self._staging_pool(nbytes).try_lease(nbytes)
        if lease is not None:
            return lease
        if self._spares:
            return self._spares.pop()
        return self._staging_pool(nbytes).outside(nbytes)

    def _hand_back(self, lease: StagingLease | None) -> None:
        """A staging buffer no job reads any more: back to the pool, or kept as this writer's spare."""
        if lease is not None and lease.pooled:
            lease.release()
        elif lease is not None:
            self._spares.append(lease)

    def _staging_pool(self, nbytes: int) -> PinnedPool:
        if self._staging is None:  # without the store's pool: a ring of this writer's own, as many as it leases
            self._staging = self.store.staging_pool() or PinnedPool(MAX_PENDING_LAYERS * size_class(nbytes))
        return self._staging

    def write_layer_pages(self, layer: int, arr: np.ndarray) -> None:
        """Store one layer already laid out as page-file bytes ``uint8 [kv_heads, n_pages, page_bytes]``.

        Checksums and the durable write may run in the background until ``commit``: ``arr`` must not
        change until then; a failure raises from a later ``write_layer_pages`` or from ``commit``."""
        self._write_pages(layer, arr, None)

    def _write_pages(self, layer: int, arr: np.ndarray, lease: StagingLease | None,
                     copied: HostCopy | None = None) -> None:
        """``write_layer_pages``, with the staging buffer ``arr`` lives in (handed back once its jobs are done), and
        the copy into it each job waits for first (None: the bytes are there). When this raises, no job reads
        ``arr``."""
        lay = self.layout
        expect = (lay.n_kv_heads, lay.n_pages(self.n_tokens), lay.page_bytes)
        if arr.dtype != np.uint8 or tuple(arr.shape) != expect:
            raise InvalidInput(f"layer {layer}: pages must be uint8 {expect}, got {arr.dtype} {tuple(arr.shape)}")
        self._check_new_layer(layer)
        name = layer_file_name(layer)
        # Bounded pipeline: at most MAX_PENDING_LAYERS layers' bytes are held while being written.
        self._drain(MAX_PENDING_LAYERS - 1)
        jobs: list[Future] = []
        try:
            jobs.append(self._run(_after(copied, functools.partial(write_bytes_durably, self.tmp_dir / name, arr,
                                                                   self._fsync))))
            for h in range(lay.n_kv_heads):
                jobs.append(self._run(_after(copied, functools.partial(self._page_crcs, layer, arr, h))))
        except BaseException:
            wait(jobs)  # the ones already started finish before the caller may reuse ``arr``
            raise
        self._pending.append(PendingLayer(layer, name, arr.nbytes, jobs, lease))

    def _check_new_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {self.layout.n_layers})")
        if layer in self._files or layer in self._streams or any(p.layer == layer for p in self._pending):
            raise InvalidInput(f"layer {layer} was already written")

    def open_layer(self, layer: int) -> LayerStream:
        """A sink for one layer's page-file bytes as they arrive, in order (memory stays under one page);
        ``LayerStream.close`` once all of them are written."""
        self._check_new_layer(layer)
        if len(self._streams) >= MAX_OPEN_STREAMS:
            raise InvalidInput(f"at most {MAX_OPEN_STREAMS} layers may be streamed at once")
        stream = LayerStream(self, layer)
        self._streams[layer] = stream
        return stream

    def _finish_stream(self, stream: LayerStream, info: FileInfo, crcs: np.ndarray) -> None:
        del self._streams[stream.layer]
        self._crc[stream.layer] = crcs
        self._files[stream.layer] = info

    def _run(self, job: Callable[[], object]) -> Future:
        """``job`` on the writer's threads, or now on this one when it has none."""
        if self._pool is not None:
            return self._pool.submit(job)
        done: Future = Future()
        done.set_result(job())
        return done

    def _page_crcs(self, layer: int, arr: np.ndarray, head: int) -> None:
        n_pages = arr.shape[1]
        self._crc[layer, head] = page_crcs(self.prefix_id, layer, n_pages, head * n_pages, arr[head], arr.shape[2])

    def _drain(self, keep: int) -> None:
        """Wait for pending layer writes until at most ``keep`` remain; the first failure raises."""
        while len(self._pending) > keep:
            p = self._pending.pop(0)
            p.settle()
            self._hand_back(p.lease)
            for f in p.jobs:
                f.result()
            self._files[p.layer] = FileInfo(name=p.name, size=p.size, check=PAGE_CRCS)

    def put_artifact(self, name: str, data: ArtifactData) -> None:
        """Write an artifact to its file in the temp dir now (``open_artifact`` fed every chunk of ``data``)."""
        with self.open_artifact(name) as stream:
            for chunk in as_chunks(data):
                stream.write(chunk)

    def open_artifact(self, name: str) -> ArtifactStream:
        """A sink for one artifact's bytes as they arrive, written to its file in the temp dir as they come
        (committed with the manifest once ``ArtifactStream.close`` recorded it; a later one of the same name
        replaces it). InvalidInput past ``MAX_ARTIFACTS`` or, as soon as a write would go past it, the prefix's
        artifact budget (``store.limits.max_artifact_bytes``, the page checksums included)."""
        check_text("artifact name", name)
        if self._sealed:
            raise InvalidInput("this prefix's commit has already started")
        if not name or name == PAGE_CRC_ARTIFACT:
            raise InvalidInput(f"invalid artifact name {name!r}")
        if name in self._artifact_streams:
            raise InvalidInput(f"artifact {name!r} is already being written")
        names = set(self._artifacts) | set(self._artifact_streams)
        if name not in names and len(names) >= MAX_ARTIFACTS:
            raise InvalidInput(f"a prefix holds at most {MAX_ARTIFACTS} artifacts")
        return self._open_stream(name, budgeted=True)

    def _open_stream(self, name: str, *, budgeted: bool) -> ArtifactStream:
        staged = f"{STAGED_PREFIX}{self._n_staged:03d}"
        self._n_staged += 1
        stream = ArtifactStream(self, name, self.tmp_dir / staged, fsync=self._fsync, budgeted=budgeted)
        self._artifact_streams[name] = stream
        return stream

    def _check_artifact_room(self, stream: ArtifactStream, size: int) -> None:
        """InvalidInput when ``stream`` growing to ``size`` bytes would put the artifacts past the budget; else the
        room is claimed for it."""
        with self._room_lock:
            others = sum(info.size for n, (_, info) in self._artifacts.items() if n != stream.name)
            others += sum(c for n, c in self._claimed.items() if n != stream.name)
            if others + size + self._crc.nbytes > self._artifact_budget:
                raise InvalidInput(f"the artifacts of this prefix may take at most {self._artifact_budget} bytes "
                                   f"together (its page files' size, or store.limits.MIN_ARTIFACT_BUDGET when "
                                   f"more): {others + size} bytes and its page checksums do not fit")
            self._claimed[stream.name] = size

    def _finish_artifact(self, stream: ArtifactStream, info: ArtifactInfo) -> None:
        """Record a closed artifact stream, then drop any older one of its name."""
        with self._room_lock:
            self._forget_stream(stream)
            old = self._artifacts.get(stream.name)
            self._artifacts[stream.name] = (stream.staged, info)
        if old is not None:
            (self.tmp_dir / old[0]).unlink(missing_ok=True)

    def _drop_artifact(self, stream: ArtifactStream) -> None:
        with self._room_lock:
            self._forget_stream(stream)

    def _forget_stream(self, stream: ArtifactStream) -> None:
        if self._artifact_streams.get(stream.name) is stream:
            del self._artifact_streams[stream.name]
            self._claimed.pop(stream.name, None)

    def _stage(self, name: str, data: bytes) -> None:
        """Write an artifact the writer makes itself (outside the budget, which reserves its room)."""
        with self._open_stream(name, budgeted=False) as stream:
            stream.write(data)

    def commit(self) -> Manifest:
        """Make the prefix visible (and durable, or durable soon after with ``StoreConfig.sync_after_commit``):
        staged artifacts renamed to their final names and the manifest written into the temp dir (the manifest
        last), the dir renamed into place (the commit point on disk), then the metadata commit."""
        self._drain(0)
        self._shutdown()
        missing = sorted(set(range(self.layout.n_layers)) - set(self._files))
        if missing:
            raise InvalidInput(f"cannot commit: layers {missing} were not written")
        if self._sealed:
            raise InvalidInput("this prefix's commit has already started")
        if self._artifact_streams:
            raise InvalidInput(f"cannot commit: {len(self._artifact_streams)} artifact(s) are still being written")
        self._sealed = True
        self._stage(PAGE_CRC_ARTIFACT, self._crc.tobytes())
        staged = sorted(self._artifacts.items())
        for i, (_, (file, _)) in enumerate(staged):
            os.rename(self.tmp_dir / file, self.tmp_dir / artifact_file_name(i))
        manifest = Manifest(
            prefix_id=self.prefix_id, key=self.key, model_name=self.model_name, n_tokens=self.n_tokens,
            files=tuple(self._files[i] for i in range(self.layout.n_layers)),
            artifacts=tuple(info for _, (_, info) in staged), created_at=time.time(), tenant=self.tenant,
        )
        with self.store.quota_guard(self.tenant, prefix_bytes(manifest)):  # quotas hold across concurrent commits
            self._publish(manifest)
        return manifest

    def _publish(self, manifest: Manifest) -> None:
        """Write the manifest, rename the directory into place, register it (taken back when the metadata is full)."""
        fsync = self._fsync
        publish(self.tmp_dir, manifest, fsync=fsync)  # fsyncs the dir: the artifacts' renames are durable too
        final = self.store.prefix_dir(self.prefix_id)
        if final.exists():  # an older copy the metadata does not list (we hold the prefill lock): replace it
            old = self.store.prefixes_dir / tmp_dir_name(self.prefix_id)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(self.tmp_dir, final)
        if fsync:
            fsync_dir(self.store.prefixes_dir)
        try:
            self.store._commit(manifest)
        except StoreFull:  # the metadata has no room for it: take the directory back (a full disk keeps no
            gone = self.store.prefixes_dir / tmp_dir_name(self.prefix_id)  # prefix nobody lists)
            os.rename(final, gone)
            shutil.rmtree(gone, ignore_errors=True)
            raise
        if self._marker is not None:
            self.store.sync_later(final, self._marker)

    def abort(self) -> None:
        """Discard everything written so far."""
        for stream in list(self._streams.values()):
            stream.discard()
        for artifact in list(self._artifact_streams.values()):
            artifact.discard()
        for p in self._pending:
            for f in p.jobs:
                f.cancel()
        self._shutdown()  # running writes finish before their files are removed (and their buffers go back)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _shutdown(self) -> None:
        """Stop the writer's threads once their jobs are done, then hand back every staging buffer."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for p in self._pending:  # every job is done or cancelled: nothing reads their buffers
            self._hand_back(p.lease)
        self._pending.clear()
        for spare in self._spares:
            spare.release()
        self._spares.clear()
        self._staging = None  # a pool of this writer's own is freed with it


class LayerStream:
    """One layer's page file, written as its bytes arrive: the per-page CRCs are computed on the way (one kernel
    call per write for its whole pages), so nothing but a partial page is held in memory."""

    def __init__(self, writer: PrefixWriter, layer: int) -> None:
        lay = writer.layout
        self.layer, self.size, self.written = layer, lay.layer_file_bytes(writer.n_tokens), 0
        self._writer, self._page_bytes, self._n_pages = writer, lay.page_bytes, lay.n_pages(writer.n_tokens)
        self._name = layer_file_name(layer)
        self._file = open(writer.tmp_dir / self._name, "wb")  # noqa: SIM115 - closed by close/discard
        self._carry = bytearray()
        self._crcs = np.zeros((lay.n_kv_heads, self._n_pages), dtype=np.uint32)
        self._next_page = 0

    def write(self, data: bytes | memoryview) -> None:
        """Append the next bytes of the layer file; InvalidInput past its size."""
        if self.written + len(data) > self.size:
            raise InvalidInput(f"layer {self.layer}: more than its {self.size} bytes")
        self._file.write(data)
        self.written += len(data)
        mv, pb = memoryview(data).cast("B"), self._page_bytes
        if self._carry:
            take = pb - len(self._carry)
            self._carry += mv[:take]
            mv = mv[take:]
            if len(self._carry) < pb:
                return
            self._pages(self._carry)
            self._carry = bytearray()
        whole = len(mv) - len(mv) % pb
        if whole:
            self._pages(mv[:whole])
        self._carry += mv[whole:]

    def _pages(self, payload: bytes | bytearray | memoryview) -> None:
        """CRCs of the next whole pages (``payload``: a multiple of the page size)."""
        crcs = page_crcs(self._writer.prefix_id, self.layer, self._n_pages, self._next_page, payload,
                         self._page_bytes)
        self._crcs.reshape(-1)[self._next_page:self._next_page + crcs.shape[0]] = crcs
        self._next_page += crcs.shape[0]

    def close(self) -> None:
        """Finish the layer (durable unless the store skips fsync); InvalidInput when bytes are missing."""
        if self.written != self.size:
            raise InvalidInput(f"layer {self.layer}: {self.written} of its {self.size} bytes were written")
        self._file.flush()
        if self._writer.fsyncs_each_file:
            os.fsync(self._file.fileno())
        self._file.close()
        info = FileInfo(name=self._name, size=self.size, check=PAGE_CRCS)
        self._writer._finish_stream(self, info, self._crcs)

    def discard(self) -> None:
        """Close the file without finishing the layer (the writer's abort removes it)."""
        self._file.close()
        self._writer._streams.pop(self.layer, None)


class ClosedOrDiscarded:
    """A context manager that ``close``s on success and ``discard``s on an exception."""

    def close(self) -> None:
        """Finish (subclasses)."""
        raise NotImplementedError

    def discard(self) -> None:
        """Drop what was written (subclasses)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class ArtifactStream(ClosedOrDiscarded):
    """One artifact, written to its staged file as its bytes arrive (digest computed on the way, room checked
    before each write): memory holds one ``write`` at most. Recorded by ``close`` in its home (a ``PrefixWriter``
    or an artifact added to a committed prefix); a context manager that closes on success and discards on an
    exception."""

    def __init__(self, home: ArtifactHome, name: str, path: Path, *, fsync: bool, budgeted: bool = True) -> None:
        self.name, self.staged, self.path, self.written = name, path.name, path, 0
        self._home, self._fsync, self._budgeted = home, fsync, budgeted
        self._file: BinaryIO | None = open(path, "wb")  # noqa: SIM115 - closed by close/discard
        self._hash = new_digest()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append the next bytes of the artifact; the home's refusal (InvalidInput past a prefix's budget, say) or
        a failed write discards the stream and raises."""
        if self._file is None:
            raise InvalidInput("this artifact stream is closed")
        size = memoryview(data).nbytes
        try:
            if self._budgeted:
                self._home._check_artifact_room(self, self.written + size)
            self._file.write(data)
        except BaseException:
            self.discard()
            raise
        self._hash.update(data)
        self.written += size

    def sync(self) -> None:
        """Make the bytes written so far durable now (unless the store skips fsync): a long artifact's bytes then
        reach the disk while it is written, not all at its close."""
        if self._file is None:
            raise InvalidInput("this artifact stream is closed")
        if self._fsync:
            self._file.flush()
            os.fdatasync(self._file.fileno())

    def close(self) -> None:
        """Finish the artifact (durable unless the store skips fsync) and record it in the writer."""
        if self._file is None:
            raise InvalidInput("this artifact stream is closed")
        f, self._file = self._file, None
        try:
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        except BaseException:
            f.close()
            self._remove()
            raise
        f.close()
        self._home._finish_artifact(self, ArtifactInfo(name=self.name, size=self.written,
                                                       blake2b=self._hash.hexdigest()))

    def discard(self) -> None:
        """Drop the artifact: its staged file removed, nothing recorded (nothing if already closed)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        self._remove()

    def _remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self._home._drop_artifact(self)
