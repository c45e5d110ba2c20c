"""Lock helpers shared by the metadata backends: a per-file flock and a TTL renewer thread."""

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


@contextlib.contextmanager
def file_lock(path: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (threads and processes of one host contend).

    The file is unlinked on release, so lock files do not pile up; a waiter that took
    the lock on an unlinked inode notices and retries on the new file. A crashed holder
    releases the lock with its file descriptors. Raises ``LockTimeout`` after ``wait_s``.
    """
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        if not _take(fd, deadline):
            os.close(fd)
            raise LockTimeout(f"lock {path.name} is held by another writer (waited {wait_s} s)")
        if _same_file(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


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
