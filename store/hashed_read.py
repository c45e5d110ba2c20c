"""Reading a file whole while hashing it: chunks are read by a few threads at once, hashed in file order by
another, and a caller may use the bytes that have arrived before the whole file is read and checked.

Opening a prefix reads its summaries (at 128k, Quest's page bounds are 268 MB for 8 layers) and checks their
blake2b digest before any token that depends on them goes out. On the H200's virtual disk one thread reading the
file then hashing it took 0.86-1.08 s cold: a single sequential reader gets well under the disk's rate, which
several requests in flight approach. So ``READ_THREADS`` threads read chunks ahead (``os.preadv`` into one
buffer: no copies, the GIL released), a hashing thread (blake2b is GIL-free too) takes each chunk as soon as it
and those before it are in, and ``wait_for`` lets a reader of a layer-by-layer artifact start on layer 0 while
the later layers are still on their way (``result`` then says whether the whole file was what the manifest
recorded). The digest stays blake2b over the whole file, so manifests written before are read the same way.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from store.artifacts import new_digest

READ_CHUNK = 8 << 20
"""Bytes per read call: large enough that a call's overhead is nothing, small enough that several are in flight
for a summary of tens of MB and the hash of the last one (not overlapped) is short."""
READ_THREADS = 4
"""Reads in flight (the disk's sequential rate needs a few; the hash, about 1 GB/s, is the limit beyond)."""


class HashedRead:
    """The first ``size`` bytes of a file, being read in the background (started at construction) and hashed in
    file order. OSError at once when the file cannot be opened."""

    def __init__(self, path: Path, size: int, *, chunk: int | None = None, threads: int | None = None):
        chunk = READ_CHUNK if chunk is None else chunk  # looked up per read (tests shrink them)
        threads = READ_THREADS if threads is None else threads
        if size < 0 or chunk < 1 or threads < 1:
            raise ValueError(f"size must be >= 0, chunk and threads >= 1; got {size}, {chunk}, {threads}")
        self.size = size
        self.buffer = bytearray(size)
        """The bytes; those below ``wait_for``'s mark are final (views of it stay valid: it is never resized)."""
        self._view = memoryview(self.buffer)
        self._chunk = chunk
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._cond = threading.Condition()
        self._arrived = 0  # bytes [0, _arrived) are read
        self._done = False
        self._digest: str | None = None  # set when done, None: not exactly ``size`` bytes
        self._error: BaseException | None = None
        starts = range(0, size, chunk)
        self._pool = ThreadPoolExecutor(max(1, min(threads, len(starts))), thread_name_prefix="kvstash-read")
        try:
            futures = [self._pool.submit(self._fill, lo) for lo in starts]
            threading.Thread(target=self._hash, args=(starts, futures), name="kvstash-hash", daemon=True).start()
        except BaseException:
            self._pool.shutdown(wait=True, cancel_futures=True)
            os.close(self._fd)
            raise

    def _fill(self, lo: int) -> int:
        """Read ``[lo, lo + chunk)`` (to ``size``); the bytes read, fewer only at the file's end."""
        hi, n = min(self.size, lo + self._chunk), lo
        while n < hi and (got := os.preadv(self._fd, [self._view[n:hi]], n)):
            n += got
        return n - lo

    def _hash(self, starts: range, futures: list[Future[int]]) -> None:
        h, n, digest, error = new_digest(), 0, None, None
        try:
            for lo, fut in zip(starts, futures, strict=True):
                got = fut.result()
                with self._cond:
                    self._arrived = n = lo + got
                    self._cond.notify_all()
                h.update(self._view[lo:lo + got])
                if got < min(self._chunk, self.size - lo):
                    break  # the file ends here
            if n == self.size and not os.pread(self._fd, 1, self.size):
                digest = h.hexdigest()
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            error = e
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            os.close(self._fd)
            with self._cond:
                self._done, self._digest, self._error = True, digest, error
                self._cond.notify_all()

    def wait_for(self, end: int) -> bool:
        """Wait until bytes ``[0, end)`` are read; False when the file ends before ``end`` (OSError when a read
        failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._arrived >= min(end, self.size) or self._done)
            if self._error is not None:
                raise self._error
            return self._arrived >= end

    def result(self) -> tuple[bytearray, str | None]:
        """Wait for the whole read: the bytes read (fewer than ``size`` when the file is shorter) and their blake2b
        hex digest, None when the file holds fewer or more than ``size`` bytes (OSError when a read failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done)
            if self._error is not None:
                raise self._error
            n, digest = self._arrived, self._digest
        return (self.buffer if n == self.size else self.buffer[:n]), digest


def read_hashed(path: Path, size: int, *, chunk: int | None = None, threads: int | None = None
                ) -> tuple[bytearray, str | None]:
    """The first ``size`` bytes of the file (fewer when it ends sooner) and their blake2b hex digest; the
    digest is None when the file holds fewer or more than ``size`` bytes (one byte past ``size`` is read to
    tell). OSError when it cannot be read."""
    return HashedRead(path, size, chunk=chunk, threads=threads).result()
