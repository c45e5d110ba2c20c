"""Reading a file whole while hashing it: the digest of one chunk runs while the next chunk is read.

Opening a prefix reads its summaries (at 128k, Quest's page bounds are 268 MB for 8 layers) and checks
their blake2b digest before anything uses them. Read then hashed, a cold open pays the disk's time and the
hash's time one after the other (each about 0.2-0.3 s there); both release the GIL, so a second thread
hashing chunk i while chunk i + 1 is read makes it about the slower of the two. The digest stays blake2b
over the whole file, so manifests written before are read the same way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from store.artifacts import new_digest

READ_CHUNK = 8 << 20
"""Bytes per read call: large enough that a call's overhead is nothing, small enough that the hash of the
last chunk (not overlapped) is short."""


def read_hashed(f: BinaryIO, size: int, *, chunk: int = READ_CHUNK) -> tuple[bytearray, str | None]:
    """The first ``size`` bytes of ``f`` (fewer when it ends sooner) and their blake2b hex digest; the
    digest is None when ``f`` holds fewer or more than ``size`` bytes (one byte past ``size`` is read to
    tell)."""
    if size < 0 or chunk < 1:
        raise ValueError(f"size must be >= 0 and chunk >= 1, got {size} and {chunk}")
    buf = bytearray(size)
    view = memoryview(buf)
    h = new_digest()
    n = 0
    pending: Future[None] | None = None
    # One hashing thread, only when there is more than one chunk to overlap.
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvstash-hash") if size > chunk else None
    try:
        while n < size:
            got = f.readinto(view[n:min(size, n + chunk)])
            if not got:
                break
            if pending is not None:
                pending.result()  # updates stay in file order
            part = view[n:n + got]
            if pool is None:
                h.update(part)
            else:
                pending = pool.submit(h.update, part)
            n += got
        if pending is not None:
            pending.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    if n < size:
        del view
        return buf[:n], None
    return buf, (h.hexdigest() if not f.read(1) else None)
