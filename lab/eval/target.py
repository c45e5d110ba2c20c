"""What the accuracy harness needs from a client: prefill, generate, and the worker's tokenizer.

``client.KVClient`` satisfies it; lab sits below client, so it names the shape, not the class.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from workers.requests import QUERY_PAGES

if TYPE_CHECKING:
    from workers.engine import Worker


class Prefilled(Protocol):
    """A stored prefix, named by its id."""

    @property
    def prefix_id(self) -> str: ...


class ReadStats(Protocol):
    """The read counters of one generation."""

    @property
    def bytes_fetched(self) -> int: ...

    @property
    def bytes_full(self) -> int: ...


class Answer(Protocol):
    """A finished generation: its text and what it read."""

    @property
    def text(self) -> str: ...

    @property
    def stats(self) -> ReadStats: ...

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class EvalTarget(Protocol):
    """A client the harness prefills samples into and asks their queries."""

    @property
    def worker(self) -> Worker: ...

    def prefill(self, document: str) -> Prefilled: ...

    def generate(self, query: str, prefix: str, *, max_new_tokens: int, method: str, budget: float | None,
                 raw: bool, gen_len: int, budget_tokens: int | None, ratio: float | None = None,
                 query_pages: str = QUERY_PAGES[0]) -> Answer: ...
