"""Haystacks (repeated noise, natural text, other needles) and fitting them to a token budget."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence

from lab.synth.context import SynthContext

NOISE = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
MAX_TRIM_ROUNDS = 64
MAX_SKIPPED_UNITS = 16
MIN_GAP_TOKENS = 4

Stream = Iterator[str]
"""Haystack units, each with its leading separator (' ' or '\\n')."""


def noise_stream() -> Stream:
    """RULER's repeated-noise haystack."""
    return (" " + s for s in itertools.cycle(NOISE))


def text_stream(ctx: SynthContext, rng: random.Random, newlines: bool = True) -> Stream:
    """Consecutive natural-text sentences of the split, from a random start, wrapping around."""
    units = ctx.sentences()
    start = rng.randrange(len(units))
    for i in itertools.count(start):
        sep, sent = units[i % len(units)]
        yield (sep if newlines else " ") + sent


def generated_stream(make: Callable[[], str]) -> Stream:
    """Units made one by one (e.g. distractor needles)."""
    while True:
        yield " " + make()


def take(ctx: SynthContext, stream: Stream, budget: int) -> list[str]:
    """Units from `stream` while they fit in `budget` tokens (a few that do not are skipped)."""
    units, total, skipped = [], 0, 0
    for unit in stream:
        n = ctx.count_unit(unit)
        if total + n > budget:
            skipped += 1
            if skipped > MAX_SKIPPED_UNITS or budget - total < MIN_GAP_TOKENS:
                break
            continue
        units.append(unit)
        total += n
    return units


def assemble(units: Sequence[str], needles: Sequence[str], depths: Sequence[float]) -> str:
    """Insert each needle at its depth (0 = start, 1 = end) between units; join to a document."""
    slots: dict[int, list[str]] = {}
    for needle, depth in sorted(zip(needles, depths), key=lambda nd: nd[1]):
        slots.setdefault(round(depth * len(units)), []).append(" " + needle)
    parts: list[str] = []
    for i in range(len(units) + 1):
        parts.extend(slots.get(i, ()))
        if i < len(units):
            parts.append(units[i])
    return "".join(parts).lstrip()


def fit(
    ctx: SynthContext,
    stream: Stream,
    needles: Sequence[str],
    depths: Sequence[float],
    budget: int,
) -> str:
    """A document of at most `budget` tokens: haystack units from `stream` plus the needles."""
    return fit_units(ctx, stream, needles, depths, budget)[0]


def fit_units(
    ctx: SynthContext,
    stream: Stream,
    needles: Sequence[str],
    depths: Sequence[float],
    budget: int,
) -> tuple[str, list[str]]:
    """Like `fit`, also returning the haystack units the document kept."""
    fixed = sum(ctx.count_unit(" " + n) for n in needles)
    units = take(ctx, stream, budget - fixed)
    doc = assemble(units, needles, depths)
    for _ in range(MAX_TRIM_ROUNDS):
        excess = ctx.count(doc) - budget
        if excess <= 0 or not units:
            break
        del units[-max(1, len(units) * excess // (4 * budget)) :]
        doc = assemble(units, needles, depths)
    return doc, units


def document_budget(ctx: SynthContext, n_tokens: int, queries: Sequence[str]) -> int:
    """Tokens left for the document when the prompt (specials, document, queries) has `n_tokens`."""
    budget = n_tokens - ctx.special_tokens - sum(ctx.count(q) for q in queries)
    if budget <= 0:
        raise ValueError(f"n_tokens={n_tokens} is too small for the queries; use a longer length")
    return budget
