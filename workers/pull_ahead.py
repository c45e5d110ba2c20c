"""An iterator pulled on a thread of its own, a bounded number of items ahead of its consumer."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Generator, Iterable
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def pull_ahead(items: Iterable[T], depth: int, *, name: str = "pull-ahead") -> Generator[T, None, None]:
    """``items`` in order, produced on a thread at most ``depth`` items ahead of the caller, so producing the next
    overlaps consuming this one (a late summary's next layer is computed while this one is written). Nothing is
    pulled before the first ``next``; an error of ``items`` is raised to the caller at its place in the order; a
    caller that stops early stops the thread after the item it is producing."""
    if depth < 1:
        raise ValueError("depth must be at least 1")
    ready: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    source = iter(items)

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it
            ready.put(_Raised(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()  # a generator's own cleanup (its ``with`` blocks) runs on this thread, now

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            got = ready.get()
            if got is _DONE:
                return
            if isinstance(got, _Raised):
                raise got.error
            yield got  # type: ignore[misc]
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.1)
        thread.join()
