"""Reading a file whole while hashing it: chunks are read by a few threads at once while the caller hashes the
ones that have arrived, in file order.

Opening a prefix reads its summaries (at 128k, Quest's page bounds are 268 MB for 8 layers) and checks their
blake2b digest before anything uses them. On the H200's virtual disk one thread reading the file then hashing
it took 0.86 s cold, and one reader beside the hash 0.74 s: a single sequential reader gets well under the
disk's 1.2-1.45 GB/s, which several requests in flight reach. So ``READ_THREADS`` threads read chunks
ahead (``os.preadv`` into one buffer: no copies, the GIL released), and the hash (also GIL-free) runs over
each chunk as soon as it and those before it are in. The digest stays blake2b over the whole file, so
manifests written before are read the same way.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from store.artifacts import new_digest

READ_CHUNK = 8 << 20
"""Bytes per read call: large enough that a call's overhead is nothing, small enough that several are in flight
for a summary of tens of MB and the hash of the last one (not overlapped) is short."""
READ_THREADS = 4
"""Reads in flight (the disk's sequential rate needs a few; the hash, about 1 GB/s, is the limit beyond)."""


def read_hashed(path: Path, size: int, *, chunk: int = READ_CHUNK, threads: int = READ_THREADS
                ) -> tuple[bytearray, str | None]:
    """The first ``size`` bytes of the file (fewer when it ends sooner) and their blake2b hex digest; the
    digest is None when the file holds fewer or more than ``size`` bytes (one byte past ``size`` is read to
    tell). OSError when it cannot be read."""
    if size < 0 or chunk < 1 or threads < 1:
        raise ValueError(f"size must be >= 0, chunk and threads >= 1; got {size}, {chunk}, {threads}")
    buf = bytearray(size)
    view = memoryview(buf)
    h = new_digest()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        def fill(lo: int) -> int:
            """Read ``view[lo:lo + chunk]`` (to ``size``); the bytes read, fewer only at the file's end."""
            hi, n = min(size, lo + chunk), lo
            while n < hi and (got := os.preadv(fd, [view[n:hi]], n)):
                n += got
            return n - lo

        starts = range(0, size, chunk)
        n = 0
        if len(starts) <= 1:
            n = fill(0) if size else 0
            h.update(view[:n])
        else:
            with ThreadPoolExecutor(min(threads, len(starts)), thread_name_prefix="kvstash-read") as pool:
                try:
                    futures = [pool.submit(fill, lo) for lo in starts]
                    for lo, fut in zip(starts, futures, strict=True):
                        got = fut.result()
                        h.update(view[lo:lo + got])
                        n += got
                        if got < min(chunk, size - lo):
                            break  # the file ends here
                finally:
                    pool.shutdown(wait=True, cancel_futures=True)  # no read outlives the buffer's use
        longer = n == size and len(os.pread(fd, 1, size)) > 0
    finally:
        os.close(fd)
    if n < size:
        del view
        return buf[:n], None
    return buf, (None if longer else h.hexdigest())
