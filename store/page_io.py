"""Batched page reads: one call per (layer, step) reads every requested (head, page) of a layer file.

A layer file stores pages ``[kv_head][page]`` with stride ``page_bytes``, so the *linear* page index
``head * n_pages + page`` orders pages as the file does. ``plan_runs`` coalesces sorted linear
indices into maximal runs of consecutive pages; each run is one read into consecutive rows of a
staging buffer. Two readers: POSIX ``preadv`` (optionally ``O_DIRECT``; with a pool, up to ``depth``
reads in flight on as many threads: ``preadv`` releases the GIL, and random 4-16 KiB reads reach an
SSD's ceiling only with many queued) and kvikio (one ``CuFile.pread`` future per run; kvikio's
compat mode where the machine has no GPUDirect Storage). Never one future per page.

Fail closed: a missing or wrongly sized file, a short read, an I/O error, or (``verify_pages``) a
page whose keyed CRC does not match the identity asked for raises ``CorruptData``.
"""

from __future__ import annotations

import abc
import functools
import importlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from store.crc_batch import chunk_crc, chunk_pages, expected_chunk_crcs, page_seeds
from store.errors import CorruptData
from store.page_crc_native import native_available, page_crcs
from store.pages import page_crc

DIRECT_ALIGN = 4096
"""Buffer, offset and size alignment ``O_DIRECT`` needs (page files are aligned to it)."""
SPLIT_BYTES = 8 << 20
"""With several reads in flight, runs longer than this are split so that threads share one big read."""
PARALLEL_MIN_BYTES = 64 << 10
"""Below this many bytes per call, threads cost more than they save: read on the calling thread."""
VERIFY_CHUNK_BYTES = 1 << 20
"""Bytes of pages one ``zlib.crc32`` call checks (it releases the GIL; a chunk that fails is re-checked per page)."""


@dataclass(frozen=True)
class ReadPlan:
    """Maximal runs of consecutive pages among sorted unique linear page indices."""

    linear: np.ndarray
    """``[n]`` int64 linear page indices (``head * n_pages + page``), strictly increasing."""
    starts: np.ndarray
    """``[runs]`` row (in ``linear`` and in the staging buffer) where each run starts."""
    counts: np.ndarray
    """``[runs]`` pages per run."""

    @property
    def n_runs(self) -> int:
        """Number of runs: the fewest reads that fetch exactly these pages."""
        return int(self.starts.shape[0])

    @property
    def n_pages(self) -> int:
        """Pages requested."""
        return int(self.linear.shape[0])


def plan_runs(linear: np.ndarray | Sequence[int], max_pages: int | None = None) -> ReadPlan:
    """Coalesce strictly increasing linear page indices into runs (each at most ``max_pages`` long)."""
    lin = np.ascontiguousarray(linear, dtype=np.int64)
    if lin.ndim != 1:
        raise ValueError(f"linear page indices must be 1-D, got shape {lin.shape}")
    if lin.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ReadPlan(lin, empty, empty)
    step = np.diff(lin)
    if (step <= 0).any():
        raise ValueError("linear page indices must be strictly increasing (sort and deduplicate them)")
    starts = np.concatenate([[0], np.flatnonzero(step != 1) + 1]).astype(np.int64)
    counts = np.diff(np.append(starts, lin.size))
    if max_pages is not None and (counts > max_pages).any():
        pieces = [(s + off, min(max_pages, c - off)) for s, c in zip(starts.tolist(), counts.tolist())
                  for off in range(0, c, max_pages)]
        starts = np.array([p[0] for p in pieces], dtype=np.int64)
        counts = np.array([p[1] for p in pieces], dtype=np.int64)
    return ReadPlan(lin, starts, counts.astype(np.int64))


def _check_out(out: np.ndarray, plan: ReadPlan, page_bytes: int) -> None:
    if out.dtype != np.uint8 or out.ndim != 2 or out.shape[1] != page_bytes or out.shape[0] < plan.n_pages:
        raise ValueError(f"out must be uint8 [>= {plan.n_pages}, {page_bytes}], got {out.dtype} {out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")


def run_all(pool: Executor | None, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``tasks`` (on ``pool`` when given) and return their results in order.

    Waits for every task before raising the first error, so no task still writes a buffer the caller
    goes on to reuse.
    """
    if pool is None or len(tasks) <= 1:
        return [t() for t in tasks]
    futures = [pool.submit(t) for t in tasks]
    wait(futures)
    return [f.result() for f in futures]


class PageReader(abc.ABC):
    """Reads the runs of a ``ReadPlan`` of one layer file into consecutive rows of a host buffer."""

    name: ClassVar[str]

    @abc.abstractmethod
    def read(self, path: Path, file_bytes: int, plan: ReadPlan, page_bytes: int, out: np.ndarray) -> int:
        """Read every run of ``plan`` into ``out[:plan.n_pages]``; returns the number of read calls.

        ``file_bytes`` is the size the manifest recorded: a file of another size raises CorruptData.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release open files."""


def _size_error(path: Path, size: int, file_bytes: int) -> CorruptData:
    if size < file_bytes:
        return CorruptData(f"short read: page file {path.name} has {size} of its {file_bytes} bytes (truncated)")
    return CorruptData(f"page file {path.name} has {size} bytes, expected {file_bytes} (replaced)")


class PosixPageReader(PageReader):
    """``os.preadv`` per run, up to ``depth`` in flight on ``pool``'s threads (it needs that many);
    ``O_DIRECT`` when asked and the file system allows it."""

    name = "posix"

    def __init__(self, *, pool: Executor | None = None, depth: int = 1, direct: bool = False):
        self.pool, self.depth, self.direct = pool, max(1, depth), direct
        self.direct_active = False
        """Whether the last file opened actually uses O_DIRECT (some file systems refuse it)."""
        self._fds: dict[Path, int] = {}

    def _open(self, path: Path, file_bytes: int) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
        try:
            try:
                fd = os.open(path, flags)
            except OSError:
                if flags == os.O_RDONLY:
                    raise
                flags = os.O_RDONLY
                fd = os.open(path, flags)
        except FileNotFoundError as e:
            raise CorruptData(f"page file {path.name} is missing") from e
        except OSError as e:
            raise CorruptData(f"cannot open page file {path.name}: {e.strerror or e}") from e
        size = os.fstat(fd).st_size
        if size != file_bytes:
            os.close(fd)
            raise _size_error(path, size, file_bytes)
        self.direct_active = flags != os.O_RDONLY
        self._fds[path] = fd
        return fd

    def read(self, path: Path, file_bytes: int, plan: ReadPlan, page_bytes: int, out: np.ndarray) -> int:
        """See ``PageReader.read``."""
        _check_out(out, plan, page_bytes)
        if plan.n_runs == 0:
            return 0
        fd = self._open(path, file_bytes)
        if self.direct_active and (out.ctypes.data % DIRECT_ALIGN or page_bytes % DIRECT_ALIGN):
            raise ValueError("O_DIRECT reads need a 4 KiB aligned buffer and page size")
        total = plan.n_pages * page_bytes
        parallel = self.depth > 1 and self.pool is not None and total >= PARALLEL_MIN_BYTES
        if parallel and plan.n_runs < self.depth:
            plan = plan_runs(plan.linear, max(1, SPLIT_BYTES // page_bytes))
        flat = out.reshape(-1)
        starts, counts, first = plan.starts.tolist(), plan.counts.tolist(), plan.linear[plan.starts].tolist()
        runs = itertools.count()  # a shared queue of runs: each reader takes the next (``next`` is atomic)
        failed = threading.Event()

        def reader() -> int:
            done = 0
            try:
                while not failed.is_set() and (r := next(runs)) < len(starts):
                    dst = flat[starts[r] * page_bytes : (starts[r] + counts[r]) * page_bytes]
                    _pread_fully(fd, path, dst, first[r] * page_bytes)
                    done += 1
            except BaseException:
                failed.set()  # the others stop after their read in flight
                raise
            return done

        n_readers = min(self.depth, plan.n_runs) if parallel else 1
        return sum(run_all(self.pool if parallel else None, [reader] * n_readers))

    def close(self) -> None:
        """Close every open file."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _pread_fully(fd: int, path: Path, dst: np.ndarray, offset: int) -> None:
    """Fill ``dst`` from ``offset``; a read that ends early (EOF) or fails raises CorruptData."""
    view = dst.data.cast("B")
    done, want = 0, view.nbytes
    while done < want:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CorruptData(f"I/O error reading {path.name} at byte {offset + done}: {e.strerror or e}") from e
        if got <= 0:
            raise CorruptData(f"short read in {path.name}: {done} of {want} bytes at byte {offset} "
                              "(file truncated?)")
        done += got


_KVIKIO_POOL_LOCK = threading.Lock()


def ensure_kvikio_threads(kvikio: Any, n: int) -> int:
    """Raise kvikio's process-wide I/O thread pool to at least ``n`` threads (never lower it); the size after."""
    d = getattr(kvikio, "defaults", None) or importlib.import_module("kvikio.defaults")  # a submodule: not imported
    new_api = hasattr(d, "set") and hasattr(d, "get")
    with _KVIKIO_POOL_LOCK:
        have = int(d.get("num_threads") if new_api else d.get_num_threads())
        if have < n:
            # A reset waits for the pool's running reads, then starts the new threads: safe with reads in flight.
            if new_api:
                d.set("num_threads", n)
            else:
                d.num_threads_reset(n)
            have = n
    return have


class KvikioPageReader(PageReader):
    """kvikio ``CuFile.pread`` into host memory, one future per run, all in flight together on kvikio's
    thread pool, which is raised to at least ``depth`` threads (its default, one thread, runs them one at a time)."""

    name = "kvikio"

    def __init__(self, *, depth: int = 1) -> None:
        import kvikio  # noqa: F401 - raises ImportError when absent (open_page_reader falls back)

        self._kvikio = kvikio
        self.threads = ensure_kvikio_threads(kvikio, max(1, depth))
        """kvikio's thread pool size once this reader was made (shared by every reader of the process)."""
        self._files: dict[Path, Any] = {}

    def _open(self, path: Path, file_bytes: int) -> Any:
        f = self._files.get(path)
        if f is not None:
            return f
        try:
            size = path.stat().st_size
        except FileNotFoundError as e:
            raise CorruptData(f"page file {path.name} is missing") from e
        if size != file_bytes:
            raise _size_error(path, size, file_bytes)
        try:
            f = self._kvikio.CuFile(path, "r")
        except (OSError, RuntimeError) as e:
            raise CorruptData(f"cannot open page file {path.name} with kvikio: {e}") from e
        self._files[path] = f
        return f

    def read(self, path: Path, file_bytes: int, plan: ReadPlan, page_bytes: int, out: np.ndarray) -> int:
        """See ``PageReader.read``."""
        _check_out(out, plan, page_bytes)
        if plan.n_runs == 0:
            return 0
        f = self._open(path, file_bytes)
        pending = []
        for row, count in zip(plan.starts.tolist(), plan.counts.tolist()):
            size = count * page_bytes
            pending.append((row, size, f.pread(out[row : row + count], size, int(plan.linear[row]) * page_bytes)))
        first_error: CorruptData | None = None
        for row, size, fut in pending:  # wait for all before raising: none may still write into ``out``
            try:
                got = fut.get()
            except (OSError, RuntimeError) as e:
                first_error = first_error or CorruptData(f"I/O error reading {path.name} (kvikio): {e}")
                continue
            if got != size and first_error is None:
                first_error = CorruptData(f"short read in {path.name}: {got} of {size} bytes at page row {row}")
        if first_error is not None:
            raise first_error
        return len(pending)

    def close(self) -> None:
        """Close every open file."""
        for f in self._files.values():
            f.close()
        self._files.clear()


def kvikio_available() -> bool:
    """Whether kvikio imports."""
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


def open_page_reader(kind: str, *, cuda: bool, pool: Executor | None = None, depth: int = 1,
                     direct: bool = False) -> PageReader:
    """``auto`` (kvikio when it imports and the device is CUDA, else POSIX), ``posix`` or ``kvikio``."""
    if kind not in ("auto", "posix", "kvikio"):
        raise ValueError(f"reader must be 'auto', 'posix' or 'kvikio', got {kind!r}")
    if kind == "kvikio" or (kind == "auto" and cuda and kvikio_available()):
        return KvikioPageReader(depth=depth)
    return PosixPageReader(pool=pool, depth=depth, direct=direct)


def verify_pages(prefix_id: str, layer: int, n_pages: int, linear: np.ndarray, out: np.ndarray,
                 crcs: np.ndarray, pool: Executor | None = None, threads: int = 1) -> None:
    """Check each page ``out[i]`` against the keyed CRC of (prefix, layer, head, page) ``linear[i]``.

    ``crcs`` is the prefix's ``[kv_heads, n_pages]`` table for ``layer``. The first mismatch raises
    CorruptData naming the page: bytes of another page, layer or prefix never pass. A run of consecutive pages
    is checked by the page CRC kernel where it is built (``store.page_crc_native``: every page's CRC in one
    call per part, parts spread over ``threads``); other pages a chunk at a time (``store.crc_batch``: one C call
    per ``VERIFY_CHUNK_BYTES``, chunks spread over ``threads``), where only a chunk that fails is checked page
    by page, to name the page.
    """
    heads, pages = np.divmod(np.asarray(linear, dtype=np.int64), n_pages)
    n = int(heads.shape[0])
    if n == 0:
        return
    want = crcs[heads, pages]
    page_bytes = out.shape[1]
    first = int(linear[0])
    if native_available() and int(linear[-1]) - first == n - 1 and bool((np.diff(linear) == 1).all()):
        parts = max(1, min(threads, n)) if pool is not None else 1
        edges = np.linspace(0, n, parts + 1).astype(int).tolist()
        computed = np.concatenate(run_all(pool, [functools.partial(page_crcs, prefix_id, layer, n_pages, first + a,
                                                              out[a:b], page_bytes)
                                            for a, b in zip(edges[:-1], edges[1:])]))
        if (bad := np.flatnonzero(computed != want)).size:
            h, p = int(heads[bad[0]]), int(pages[bad[0]])
            raise CorruptData(f"prefix {prefix_id}: layer {layer} head {h} page {p} failed its checksum "
                              "(corrupt, or not the page asked for)")
        return
    per_chunk = chunk_pages(page_bytes, VERIFY_CHUNK_BYTES)
    expected = expected_chunk_crcs(want, page_seeds(prefix_id, layer, heads, pages), page_bytes, per_chunk)
    rows = out[:n]
    n_chunks = int(expected.shape[0])

    def crcs_of(lo: int, hi: int) -> list[int]:
        return [chunk_crc(rows[c * per_chunk : (c + 1) * per_chunk]) for c in range(lo, hi)]

    parts = max(1, min(threads, n_chunks)) if pool is not None else 1
    edges = np.linspace(0, n_chunks, parts + 1).astype(int).tolist()
    got = [c for part in run_all(pool, [functools.partial(crcs_of, a, b) for a, b in zip(edges[:-1], edges[1:])])
           for c in part]
    for c in np.flatnonzero(np.array(got, dtype=np.uint32) != expected).tolist():
        for i in range(c * per_chunk, min(n, (c + 1) * per_chunk)):
            h, p = int(heads[i]), int(pages[i])
            if page_crc(prefix_id, layer, h, p, rows[i].data) != want[i]:
                raise CorruptData(f"prefix {prefix_id}: layer {layer} head {h} page {p} failed its checksum "
                                  "(corrupt, or not the page asked for)")


@dataclass(frozen=True, kw_only=True)
class PageCheck:
    """What the pages of one layer file are verified against: keyed CRCs of (prefix, layer, head, page)."""

    prefix_id: str
    layer: int
    n_pages: int
    """Pages per KV head (a linear page index is ``head * n_pages + page``)."""
    crcs: np.ndarray
    """``[kv_heads, n_pages]`` uint32 CRCs of this layer (a row of ``KVStore.page_crcs``)."""


@dataclass(frozen=True)
class ReadReport:
    """What one ``read_checked`` call did."""

    calls: int
    """Read calls issued (one per coalesced run)."""
    read_s: float
    verify_s: float


def read_checked(reader: PageReader, path: Path, file_bytes: int, linear: np.ndarray | Sequence[int],
                 page_bytes: int, out: np.ndarray, check: PageCheck | None = None, *,
                 pool: Executor | None = None, threads: int = 1) -> ReadReport:
    """Read pages ``linear`` (strictly increasing ``head * n_pages + page``) of one layer file into rows
    ``out[:n]`` in coalesced runs, then (with ``check``) verify each page's keyed CRC.

    The one page-read path of the store and the workers: a wrongly sized or missing file, a short read,
    an I/O error or a page that is not the one asked for raises CorruptData.
    """
    plan = plan_runs(linear)
    t0 = time.perf_counter()
    calls = reader.read(path, file_bytes, plan, page_bytes, out)
    t1 = time.perf_counter()
    if check is not None:
        verify_pages(check.prefix_id, check.layer, check.n_pages, plan.linear, out, check.crcs, pool, threads)
    return ReadReport(calls=calls, read_s=t1 - t0, verify_s=time.perf_counter() - t1)
