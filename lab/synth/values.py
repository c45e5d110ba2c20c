"""Random needle values and keys: numbers, words, UUID-like strings, variable names."""

from __future__ import annotations

import random
import string

NUMBER_DIGITS = 7
UUID_GROUPS = (8, 4, 4, 4, 12)
VARIABLE_LETTERS = 5
HEX = "0123456789abcdef"


def number_value(rng: random.Random) -> str:
    """A 7-digit number with no leading zero."""
    return str(rng.randrange(10 ** (NUMBER_DIGITS - 1), 10**NUMBER_DIGITS))


def uuid_value(rng: random.Random) -> str:
    """A UUID-shaped lowercase hex string (8-4-4-4-12)."""
    return "-".join("".join(rng.choice(HEX) for _ in range(n)) for n in UUID_GROUPS)


def variable_name(rng: random.Random) -> str:
    """Five random uppercase letters."""
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(VARIABLE_LETTERS))


def word_key(rng: random.Random, vocab: tuple[str, ...]) -> str:
    """A two-word hyphenated key such as 'amber-lantern'."""
    return f"{rng.choice(vocab)}-{rng.choice(vocab)}"


def distinct(make, n: int, rng: random.Random, *args) -> list[str]:
    """`n` distinct values drawn with `make(rng, *args)`."""
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(make(rng, *args), None)
    return list(seen)
