"""The shipped text corpus and word lists, split into train and held-out (eval) parts."""

from __future__ import annotations

import hashlib
import lzma
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

Split = Literal["train", "eval"]

DATA_DIR = Path(__file__).parent / "data"
TRAIN_FILE = DATA_DIR / "train.txt.xz"
HELDOUT_FILE = DATA_DIR / "heldout.txt.xz"
WORDS_FILE = DATA_DIR / "words.txt.xz"
HELDOUT_WORD_PERCENT = 15  # words whose hash falls below this percentile are eval-only
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')]*\s+(?=[\"'(A-Z])")


def _read_xz(path: Path) -> str:
    return lzma.decompress(path.read_bytes()).decode()


def is_heldout_word(word: str) -> bool:
    """Whether a word belongs to the eval-only word list (stable hash split)."""
    return int(hashlib.sha1(word.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_WORD_PERCENT


@lru_cache(maxsize=2)
def words(split: Split) -> tuple[str, ...]:
    """Lowercase words (3-10 letters) of one split; the two splits are disjoint."""
    heldout = split == "eval"
    return tuple(w for w in _read_xz(WORDS_FILE).split() if is_heldout_word(w) == heldout)


@lru_cache(maxsize=2)
def paragraphs(split: Split) -> tuple[str, ...]:
    """Paragraphs of natural text: training text, or the held-out haystack text."""
    return tuple(_read_xz(TRAIN_FILE if split == "train" else HELDOUT_FILE).split("\n"))


@lru_cache(maxsize=2)
def sentences(split: Split) -> tuple[tuple[str, str], ...]:
    """The split's text as (separator, sentence) units; a separator is ' ' or '\\n'."""
    units: list[tuple[str, str]] = []
    for para in paragraphs(split):
        for i, sent in enumerate(SENTENCE_END.split(para)):
            units.append(("\n" if i == 0 else " ", sent))
    return tuple(units)
