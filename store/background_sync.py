"""Making committed prefixes durable after their commit (``StoreConfig.sync_after_commit``).

A prefill then waits for its bytes to be written, not for the disk to hold them: the prefix is served from the
page cache at once, and one background thread per store fsyncs each committed directory in commit order, then
removes its ``unsynced`` marker (``store.disk_record``). A process crash loses nothing (the page cache keeps
the bytes); a power loss can lose the prefixes still marked, and the next start verifies those in full
(``store.recovery``) and drops any that fail, so none is ever served half-written.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from store import disk_record

log = logging.getLogger(__name__)


class BackgroundSync:
    """One thread that makes committed directories durable, in the order they were committed."""

    def __init__(self, prefixes_dir: Path) -> None:
        self.prefixes_dir = prefixes_dir
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: set[Future] = set()
        self._lock = threading.Lock()

    def schedule(self, directory: Path, marker: str) -> Future:
        """fsync ``directory`` (committed, its unsynced marker holding ``marker``) then clear its marker; a future
        of whether it was made durable (False: it was removed meanwhile)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstash-sync")
            job = self._pool.submit(self._sync, directory, marker)
            self._jobs.add(job)
        job.add_done_callback(self._forget)
        return job

    def _forget(self, job: Future) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _sync(self, directory: Path, marker: str) -> bool:
        try:
            disk_record.sync_tree(directory, self.prefixes_dir)
            return disk_record.clear_unsynced(directory, marker)
        except FileNotFoundError:  # removed (evicted, deleted) before it was synced: nothing to keep
            return False
        except OSError as e:  # the marker stays: the next start verifies the prefix
            log.warning("could not make %s durable: %s", directory, e)
            return False

    def pending(self) -> int:
        """Directories waiting to be made durable (or being made so)."""
        with self._lock:
            return len(self._jobs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every directory scheduled so far is durable; whether all were done within ``timeout``."""
        with self._lock:
            jobs = list(self._jobs)
        _, not_done = wait(jobs, timeout=timeout)
        return not not_done

    def close(self) -> None:
        """Finish every scheduled sync, then stop the thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
