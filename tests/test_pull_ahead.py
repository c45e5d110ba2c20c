"""``workers.pull_ahead``: an iterator produced on its own thread, a bounded number of items ahead."""

from __future__ import annotations

import threading
import time

import pytest

from workers.pull_ahead import pull_ahead


def test_items_come_in_order_from_another_thread() -> None:
    threads: list[str] = []

    def items():
        for i in range(50):
            threads.append(threading.current_thread().name)
            yield i

    assert list(pull_ahead(items(), 3, name="producer")) == list(range(50))
    assert set(threads) == {"producer"}


def test_nothing_is_pulled_before_the_first_next() -> None:
    pulled: list[int] = []

    def items():
        for i in range(5):
            pulled.append(i)
            yield i

    it = pull_ahead(items(), 2)
    time.sleep(0.2)
    assert pulled == []
    assert next(it) == 0
    it.close()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_the_producer_stays_at_most_depth_items_ahead(depth: int) -> None:
    produced = [0]

    def items():
        for i in range(40):
            produced[0] += 1
            yield i

    it = pull_ahead(items(), depth)
    for consumed in range(1, 20):
        next(it)
        time.sleep(0.02)  # let the producer run as far as the bound allows
        # ``depth`` queued, one in the producer's hand waiting for room, and those consumed
        assert consumed <= produced[0] <= consumed + depth + 1
    it.close()


def test_an_error_is_raised_at_its_place() -> None:
    def items():
        yield 1
        yield 2
        raise KeyError("broken layer")

    it = pull_ahead(items(), 4)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(KeyError, match="broken layer"):
        next(it)


def test_stopping_early_stops_the_producer_and_closes_its_source() -> None:
    closed = threading.Event()
    produced = [0]

    def items():
        try:
            for i in range(10_000):
                produced[0] += 1
                yield i
        finally:
            closed.set()

    it = pull_ahead(items(), 2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert closed.is_set() and produced[0] <= 3 + 2 + 1
    assert not [t for t in threading.enumerate() if t.name == "pull-ahead"]


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        next(pull_ahead([1], 0))
