"""Consuming several generation streams from one thread, so that every engine step serves all of them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def drain_together(streams: Iterable[Iterator[str]]) -> None:
    """Pull one piece from each live stream in turn until every stream has ended."""
    live = list(streams)
    while live:
        for s in list(live):
            try:
                next(s)
            except StopIteration:
                live.remove(s)
