"""``drain_together``: one thread pulls several streams in turn; a failure closes the streams not yet ended."""

from __future__ import annotations

import pytest

from workers.engine import drain_together


class Stream:
    """Yields ``n`` pieces, then ends; raises at piece ``fail`` when given; records pulls and closes."""

    def __init__(self, n: int, fail: int | None = None):
        self.n, self.fail, self.pulled, self.closed = n, fail, 0, False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self.fail is not None and self.pulled == self.fail:
            raise RuntimeError("out of memory")
        if self.pulled == self.n:
            raise StopIteration
        self.pulled += 1
        return "x"

    def close(self) -> None:
        self.closed = True


def test_pulls_every_stream_to_its_end_in_turn() -> None:
    streams = [Stream(3), Stream(1), Stream(5)]
    drain_together(streams)
    assert [s.pulled for s in streams] == [3, 1, 5] and not any(s.closed for s in streams)


def test_a_failure_closes_the_streams_still_live_and_propagates() -> None:
    done, failing, live = Stream(1), Stream(5, fail=2), Stream(9)
    with pytest.raises(RuntimeError, match="out of memory"):
        drain_together([done, failing, live])
    assert live.closed and failing.closed and not done.closed  # the ended one was not live any more
    assert live.pulled == 2  # pulls went in turn up to the failure
