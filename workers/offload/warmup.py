"""Load a whole prefix into the host tier: in the caller's thread, or in the background while it decodes.

A ``HostWarmup`` reads the prefix's layer files in chunks (``OffloadConfig.warm_chunk_bytes``) with its
own reader, staging buffer and read pool (``io_depth`` reads in flight), so a generation's own fetches
(same host tier, their own reader) go on meanwhile. Per chunk: look up which pages the tier lacks
(under the tier's lock), read and CRC-check them (outside it), insert them (under it; pages a fetch
inserted in the meantime are kept). Pages enter the tier only after their checks passed, as with any fetch.

``stop`` ends a background warm-up at the next chunk boundary and joins its thread; the pages already
inserted stay in the tier (a later generation of the prefix finds them). ``done`` says it went through
every page, ``complete`` that every chunk found room in the tier (a chunk that does not fit beside the
slots other generations hold is skipped, as a fetch serves such pages from staging); ``error`` holds an
exception that ended it (``CorruptData`` from a bad page, an I/O error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from store.layout import KVLayout
from store.page_io import PageCheck, PageReader, open_page_reader, read_checked
from workers.offload.config import OffloadConfig
from workers.offload.host_tier import HostTier
from workers.offload.memory import HostBuffer


class WarmSource(Protocol):
    """What a warm-up reads from: a ``PageFetcher`` (its prefix, files, checks and host tier)."""

    prefix_id: str
    layout: KVLayout
    config: OffloadConfig
    host: HostTier | None
    n_keys: int
    cuda: bool

    def page_file(self, layer: int) -> tuple[Path, int]: ...

    def page_check(self, layer: int) -> PageCheck | None: ...


class HostWarmup:
    """Loads every page of ``fetcher``'s prefix into its host tier (``run`` here, or ``start`` a thread)."""

    def __init__(self, fetcher: WarmSource, *, layers: Iterable[int] | None = None):
        if fetcher.host is None:
            raise ValueError("a warm-up needs a fetcher with a host tier")
        self.fetcher, self.host = fetcher, fetcher.host
        lay = fetcher.layout
        self.layers = list(range(lay.n_layers) if layers is None else layers)
        self.chunk_pages = max(1, min(fetcher.config.warm_chunk_bytes // lay.page_bytes, fetcher.n_keys))
        self.bytes_read = 0
        """Bytes read from the page files so far (pages already in the tier are skipped)."""
        self.seconds = 0.0
        self.complete = True
        """False once a chunk found no room in the tier (its pages were skipped)."""
        self.error: BaseException | None = None
        """What ended the warm-up early (None: it finished, is running, or was stopped)."""
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        """Whether the warm-up went through every page (see ``complete``)."""
        return self._done.is_set()

    @property
    def running(self) -> bool:
        """Whether a background warm-up is still going."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> HostWarmup:
        """Run the warm-up on a background thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("warm-up already started")
        self._thread = threading.Thread(target=self._background, name=f"kvstash-warm-{self.fetcher.prefix_id[:8]}",
                                        daemon=True)
        self._thread.start()
        return self

    def run(self) -> int:
        """Warm the whole prefix in this thread; returns the bytes read. Raises what stopped it."""
        t0 = time.perf_counter()
        cfg = self.fetcher.config
        lay = self.fetcher.layout
        pool = ThreadPoolExecutor(cfg.io_depth, thread_name_prefix="kvstash-warm-io") if cfg.io_depth > 1 else None
        reader = open_page_reader(cfg.reader, cuda=self.fetcher.cuda, pool=pool, depth=cfg.io_depth,
                                  direct=cfg.direct_io)
        staging = HostBuffer(self.chunk_pages * lay.page_bytes, pin=False)
        try:
            buf = staging.tensor.numpy().reshape(self.chunk_pages, lay.page_bytes)
            for layer in self.layers:
                for lo in range(0, self.fetcher.n_keys, self.chunk_pages):
                    if self._stop.is_set():
                        return self.bytes_read
                    self._chunk(reader, pool, layer, lo, buf)
                    self.seconds = time.perf_counter() - t0
            self._done.set()
            return self.bytes_read
        finally:
            self.seconds = time.perf_counter() - t0
            reader.close()
            if pool is not None:
                pool.shutdown()
            staging.close()

    def _chunk(self, reader: PageReader, pool: Executor | None, layer: int, lo: int, buf: np.ndarray) -> None:
        """Read, check and insert the pages ``[lo, lo + chunk)`` of ``layer`` the tier lacks."""
        f, host, pid = self.fetcher, self.host, self.fetcher.prefix_id
        keys = np.arange(lo, min(lo + self.chunk_pages, f.n_keys), dtype=np.int64)
        base = layer * f.n_keys
        with host.lock:
            host.begin_batch()
            keys = keys[host.lookup(pid, base + keys) < 0]
        if not keys.size:
            return
        path, size = f.page_file(layer)
        out = buf[: keys.size]
        read_checked(reader, path, size, keys, f.layout.page_bytes, out, f.page_check(layer), pool=pool,
                     threads=f.config.io_threads)
        with host.lock:
            host.begin_batch()
            if host.insert(pid, base + keys, out) is None:
                self.complete = False
        self.bytes_read += int(keys.size) * f.layout.page_bytes

    def _background(self) -> None:
        try:
            self.run()
        except BaseException as e:  # kept for the generation to see (``FastOpen.poll``); the thread just ends
            self.error = e

    def stop(self) -> None:
        """Stop a background warm-up at its next chunk and wait for its thread (no-op when none)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
