"""Layer-ahead prefetch: SSD pages a later fetch will probably need, read into the host tier off the critical path.

One ``PagePrefetcher`` per ``PageFetcher`` (created on its first ``prefetch``). ``submit`` runs on the
decode thread: it drops pages the host tier already holds or a queued job already reads and queues one
job per call on a single background thread (at most ``MAX_JOBS`` queued or running; more are dropped).
A job reads its pages with the fetcher's checks (file size, short reads, keyed CRC when verifying) into
its own staging buffer, without the host-tier lock, then inserts them under the lock. A job that fails
inserts nothing (counted in ``errors``): the real fetch then reads the pages and fails closed itself.

Before a real fetch takes the host-tier lock it calls ``settle``: a queued job of that layer sharing pages
with the fetch is cancelled (the fetch reads them itself), a running one is waited for, so a page is never
read by both or inserted twice, and no fetch sees a half-copied page (inserts happen under the lock).
``served`` counts the prefetched pages real fetches then found in the host tier (``useful``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from store.errors import CorruptData
from store.page_io import PageReader, plan_runs, verify_pages
from workers.offload.host_tier import HostTier
from workers.offload.memory import HostBuffer
from workers.offload.stats import PrefetchCounts

MAX_JOBS = 2
"""Prefetch jobs queued or running at once (one runs: layer l+1's, while layer l+2's waits)."""


@dataclass(eq=False)
class _Job:
    layer: int
    keys: np.ndarray
    """Sorted linear page ids (``head * n_pages + page``) of ``layer`` to read."""
    future: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, kw_only=True)
class PrefixFiles:
    """What a prefetch job needs to read and check one prefix's pages."""

    prefix_id: str
    paths: list[Path]
    sizes: list[int]
    """Manifest size of each layer file."""
    n_pages: int
    """Pages per KV head and layer."""
    n_keys: int
    """Pages per layer (all heads): host-tier key of (layer, k) is ``layer * n_keys + k``."""
    page_bytes: int
    crcs: np.ndarray | None
    """``[layers, heads, pages]`` keyed CRCs (None: no verification)."""


class PagePrefetcher:
    """Background SSD -> host-tier reads for one generation (see the module docstring)."""

    def __init__(self, files: PrefixFiles, host: HostTier, reader: PageReader, counts: PrefetchCounts, *,
                 verify_pool: ThreadPoolExecutor | None = None, verify_threads: int = 1):
        self.files, self.host, self.reader, self.counts = files, host, reader, counts
        self._verify = (verify_pool, verify_threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstash-prefetch")
        self._jobs: list[_Job] = []
        self._marks = np.zeros(len(files.paths) * files.n_keys, dtype=bool)
        """Host-tier keys a job inserted that no real fetch has asked for yet (under the host lock)."""
        self._buf: HostBuffer | None = None

    # -- decode thread ---------------------------------------------------------------------------
    def submit(self, layer: int, keys: np.ndarray) -> int:
        """Queue a read of ``layer``'s pages ``keys`` (sorted linear ids) not yet in the host tier or queued;
        returns how many pages the job reads (0: nothing to read, or dropped)."""
        self._reap()
        f = self.files
        with self.host.lock:
            keys = keys[self.host.lookup(f.prefix_id, layer * f.n_keys + keys) < 0]
        for job in self._jobs:
            if job.layer == layer:
                keys = keys[~np.isin(keys, job.keys, assume_unique=True)]
        if not keys.size:
            return 0
        if len(self._jobs) >= MAX_JOBS or keys.size > self.host.n_slots // 2:
            self.counts.dropped += 1
            return 0
        job = _Job(layer, keys)
        job.future = self._pool.submit(self._run, job)
        self._jobs.append(job)
        self.counts.jobs += 1
        return int(keys.size)

    def settle(self, layer: int, keys: np.ndarray) -> None:
        """Before a real fetch of ``layer``'s ``keys`` (outside the host lock): cancel or wait for the jobs
        reading any of them. Re-raises an unexpected error of a finished job."""
        for job in self._jobs:
            if job.layer != layer or job.future.done() or not np.isin(job.keys, keys, assume_unique=True).any():
                continue
            if job.future.cancel():
                self.counts.dropped += 1
                continue
            t0 = time.perf_counter()
            wait_futures([job.future])
            self.counts.waits += 1
            self.counts.wait_s += time.perf_counter() - t0
        self._reap()

    def served(self, hkeys: np.ndarray, cold: np.ndarray) -> None:
        """A real fetch (under the host lock) found host-tier keys ``hkeys[~cold]`` and reads ``hkeys[cold]``."""
        hit = hkeys[~cold]
        was = hit[self._marks[hit]]
        self.counts.useful += int(was.size)
        self._marks[was] = False
        self._marks[hkeys[cold]] = False

    def wait(self) -> None:
        """Block until every queued job has run; re-raises an unexpected error of one."""
        wait_futures([j.future for j in self._jobs])
        self._reap()

    def close(self) -> None:
        """Cancel queued jobs, wait for the running one, stop the thread (errors are not raised here)."""
        for job in self._jobs:
            job.future.cancel()
        wait_futures([j.future for j in self._jobs])
        self._jobs.clear()
        self._pool.shutdown()
        self.reader.close()
        if self._buf is not None:
            self._buf.close()

    def _reap(self) -> None:
        done = [j for j in self._jobs if j.future.done()]
        self._jobs = [j for j in self._jobs if not j.future.done()]
        for job in done:
            if not job.future.cancelled():
                job.future.result()  # a CorruptData was recorded by the job; anything else is a bug: raise

    # -- prefetch thread -------------------------------------------------------------------------
    def _run(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            buf = self._read(job.layer, job.keys)
        except CorruptData:
            self.counts.errors += 1  # nothing inserted: the real fetch reads these pages and fails closed
            return
        finally:
            self.counts.read_s += time.perf_counter() - t0
        f = self.files
        hkeys = job.layer * f.n_keys + job.keys
        with self.host.lock:
            self.host.begin_batch()
            new = self.host.lookup(f.prefix_id, hkeys) < 0  # another generation may have brought some
            if not new.any():
                return
            if self.host.insert(f.prefix_id, hkeys[new], buf[new]) is None:
                self.counts.no_room += 1
                return
            self._marks[hkeys[new]] = True
            self.counts.pages += int(np.count_nonzero(new))

    def _read(self, layer: int, keys: np.ndarray) -> np.ndarray:
        """Pages ``keys`` of ``layer`` read and checked into this prefetcher's staging rows."""
        f = self.files
        n = int(keys.size)
        if self._buf is None or self._buf.tensor.numel() < n * f.page_bytes:
            if self._buf is not None:
                self._buf.close()
            self._buf = HostBuffer(2 * n * f.page_bytes, pin=False)
        buf = self._buf.tensor[: n * f.page_bytes].view(n, f.page_bytes).numpy()
        self.reader.read(f.paths[layer], f.sizes[layer], plan_runs(keys), f.page_bytes, buf)
        if f.crcs is not None:
            verify_pages(f.prefix_id, layer, f.n_pages, keys, buf, f.crcs[layer], *self._verify)
        return buf
