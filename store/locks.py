"""Lock helpers of the store: the one per-file flock (prefix and prefill locks) and a TTL renewer thread."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from store.errors import LockTimeout

log = logging.getLogger(__name__)

_POLL_S = 0.02


def _take(fd: int, deadline: float | None) -> bool:
    """flock ``fd`` exclusively; blocks forever without a deadline, else polls until it."""
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _acquire(path: Path, deadline: float | None) -> int | None:
    """An fd holding an exclusive flock on the file now at ``path``, or None when ``deadline`` passed.

    A waiter that took the lock on an inode its holder unlinked meanwhile retries on the new file.
    """
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        if not _take(fd, deadline):
            os.close(fd)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)


def _release(fd: int, path: Path) -> None:
    """Unlink the lock file (so lock files do not pile up), then drop the lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def file_lock(path: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (threads and processes of one host contend).

    The file is unlinked on release, so lock files do not pile up. A crashed holder releases
    the lock with its file descriptors. Raises ``LockTimeout`` after ``wait_s`` (forever when None).
    """
    fd = _acquire(path, None if wait_s is None else time.monotonic() + wait_s)
    if fd is None:
        raise LockTimeout(f"lock {path.name} is held by another writer (waited {wait_s} s)")
    try:
        yield
    finally:
        _release(fd, path)


@contextlib.contextmanager
def try_file_lock(path: Path) -> Iterator[bool]:
    """``file_lock`` without waiting: yields whether the lock was taken (held for the block if so)."""
    fd = _acquire(path, time.monotonic())
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(fd, path)


class Renewer:
    """Calls ``renew`` every ``interval_s`` on a daemon thread while the context is open.

    ``renew`` returns False when the lock (or lease) is lost; renewing then stops.
    """

    def __init__(self, renew: Callable[[], bool], interval_s: float, what: str) -> None:
        self._renew, self._interval, self._what = renew, interval_s, what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"renew {what}", daemon=True)
        self.lost = False
        """Whether a renewal found the lock gone (its TTL ran out before we renewed)."""

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._renew():
                self.lost = True
                log.warning("%s expired before it could be renewed", self._what)
                return

    def __enter__(self) -> Renewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
