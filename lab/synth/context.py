"""Per-process generation context: the tokenizer's counts and the split's data."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from lab.synth import corpus
from lab.synth.corpus import Split

COUNT_CACHE_SIZE = 1 << 18


class Tokenizer(Protocol):
    """What the generator needs from a tokenizer: a plain `encode` without special tokens."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class SynthContext:
    """Tokenizer and split for one process; memoizes token counts of repeated units."""

    tokenizer: Tokenizer
    split: Split = "eval"
    special_tokens: int = 1
    """Tokens the tokenizer adds to a document (the leading <s>)."""
    _cache: dict[str, int] = field(default_factory=dict, repr=False)

    def count(self, text: str) -> int:
        """Tokens in `text`, encoded without special tokens."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast path, same ids
        if backend is not None:
            return len(backend.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def count_unit(self, text: str) -> int:
        """Like `count`, memoized (for haystack sentences that recur)."""
        n = self._cache.get(text)
        if n is None:
            if len(self._cache) >= COUNT_CACHE_SIZE:
                self._cache.clear()
            n = self._cache[text] = self.count(text)
        return n

    def words(self) -> tuple[str, ...]:
        """The split's word list."""
        return corpus.words(self.split)

    def sentences(self) -> tuple[tuple[str, str], ...]:
        """The split's natural-text (separator, sentence) units."""
        return corpus.sentences(self.split)

    def rng(self, *parts: object) -> random.Random:
        """A generator seeded from the split and `parts` (stable across runs and machines)."""
        return random.Random("/".join([self.split, *map(str, parts)]))
