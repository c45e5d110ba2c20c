"""Aggregation tasks (RULER's cwe and fwe, and a query-dependent word comparison): answers
depend on counts over the whole document."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from lab.synth import haystack as hs
from lab.synth.context import SynthContext
from lab.synth.format import PROMPT
from lab.synth.sample import Sample

PROBE_WORDS = 64
MAX_FIT_ROUNDS = 64
FWE_PASSES = 3
FWE_FILL = 0.97


def tokens_per_item(ctx: SynthContext, rng: random.Random, sep: str) -> float:
    """Average tokens one word adds to a `sep`-joined list of the split's words."""
    probe = rng.sample(ctx.words(), PROBE_WORDS)
    return ctx.count(" " + sep.join(probe)) / PROBE_WORDS


def shuffled_list(counts: dict[str, int], words: list[str], sep: str, seed: float) -> str:
    """`words`, each repeated `counts[w]` times, shuffled with `seed`, joined by `sep`."""
    items = [w for w in words for _ in range(counts[w])]
    random.Random(seed).shuffle(items)
    return sep.join(items)


def fit_items(ctx: SynthContext, counts: dict[str, int], protected: set[str], sep: str, budget: int, rng) -> str:
    """The longest shuffled word list that fits `budget`: unprotected words go first, then repeats."""
    seed = rng.random()
    order = [w for w in counts if w in protected] + [w for w in counts if w not in protected]

    def fits(k: int) -> bool:
        return ctx.count(shuffled_list(counts, order[:k], sep, seed)) <= budget

    lo, hi = len(protected), len(order)
    if fits(hi):
        return shuffled_list(counts, order, sep, seed)
    while lo < hi - 1:  # invariant: hi does not fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    for _ in range(MAX_FIT_ROUNDS):
        if fits(lo):
            break
        counts = {w: max(1, n - 1 - n // 8) for w, n in counts.items()}  # too long even without extras
    return shuffled_list(counts, order[:lo], sep, seed)


def first_seen_order(doc: str, sep: str, words: set[str]) -> tuple[str, ...]:
    """`words` in the order of their first occurrence in the `sep`-joined document."""
    seen: dict[str, None] = {}
    for w in doc.split(sep):
        if w in words:
            seen.setdefault(w, None)
    return tuple(seen)


@dataclass(frozen=True, kw_only=True)
class CommonWords:
    """RULER's cwe: a word list where `n_common` words recur often; name them all."""

    name: str
    n_common: int = 10
    max_common_freq: int = 30
    rare_freq: int = 3
    sep: str = ", "

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt has at most `n_tokens` tokens; answers in first-seen order."""
        rng = ctx.rng(self.name, n_tokens, seed)
        query = PROMPT.query(f"What are the {self.n_common} most common words in the list above?")
        budget = hs.document_budget(ctx, n_tokens, [query])
        n_items = int(budget / tokens_per_item(ctx, rng, self.sep))
        freq = min(self.max_common_freq, max(self.rare_freq + 3, n_items // (3 * self.n_common)))
        n_rare = max(0, (n_items - freq * self.n_common) // self.rare_freq)
        chosen = rng.sample(ctx.words(), self.n_common + n_rare)
        common = set(chosen[: self.n_common])
        counts = {w: freq if w in common else self.rare_freq for w in chosen}
        doc = fit_items(ctx, counts, common, self.sep, budget, rng)
        answers = first_seen_order(doc, self.sep, common)
        return Sample(task=self.name, document=doc, query=query, answers=answers, target=PROMPT.target(answers))


@dataclass(frozen=True, kw_only=True)
class FrequentWords:
    """RULER's fwe: words drawn from a Zipf law; name the `n_top` most frequent, most first."""

    name: str
    n_top: int = 3
    alpha: float = 2.0
    vocab_size: int = 64
    sep: str = " "

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt has at most `n_tokens` tokens."""
        rng = ctx.rng(self.name, n_tokens, seed)
        query = PROMPT.query(f"What are the {self.n_top} most frequent words in the text above?")
        budget = hs.document_budget(ctx, n_tokens, [query])
        n_items = budget / tokens_per_item(ctx, rng, self.sep)
        vocab = rng.sample(ctx.words(), max(self.n_top + 2, min(self.vocab_size, int(n_items) // 4)))
        for _ in range(FWE_PASSES):  # later passes correct the tokens-per-item estimate
            doc = fit_items(ctx, self.zipf_counts(vocab, n_items), set(vocab[: self.n_top + 1]), self.sep, budget, rng)
            used = ctx.count(doc)
            if used >= FWE_FILL * budget:
                break
            n_items *= budget / max(1, used)
        ranked = Counter(doc.split(self.sep)).most_common(self.n_top)
        answers = tuple(w for w, _ in ranked)
        return Sample(task=self.name, document=doc, query=query, answers=answers, target=PROMPT.target(answers))

    def zipf_counts(self, vocab: list[str], n_items: float) -> dict[str, int]:
        """How often each word occurs: proportional to rank**-alpha, at least once."""
        weights = [r**-self.alpha for r in range(1, len(vocab) + 1)]
        scale = n_items / sum(weights)
        return {w: max(1, int(scale * p)) for w, p in zip(vocab, weights)}


COMPARE_ATTEMPTS = 8


@dataclass(frozen=True, kw_only=True)
class WordCompare:
    """Query-dependent aggregation: of two words named only in the question, which occurs more
    often. Other words recur about as often, so the answer cannot be read off a precomputed
    "most frequent" list; the counts are far above a small top-k budget, so every occurrence of
    both words weighs in at answer time."""

    name: str
    n_frequent: int = 6
    """Words that recur often: the two asked about plus distractors in the same count range."""
    frequent_share: float = 0.35
    """Fraction of the list's items taken by the frequent words."""
    min_ratio: float = 1.25
    max_ratio: float = 2.5
    """Bounds of (count of the more frequent word) / (count of the other)."""
    rare_freq: int = 2
    sep: str = ", "

    def __post_init__(self) -> None:
        if self.n_frequent < 2 or not 1.0 < self.min_ratio <= self.max_ratio:
            raise ValueError("need n_frequent >= 2 and 1 < min_ratio <= max_ratio")

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt has at most `n_tokens` tokens; the answer is one word."""
        rng = ctx.rng(self.name, n_tokens, seed)
        for _ in range(COMPARE_ATTEMPTS):  # a shrunk list can tie the two counts: draw again
            sample = self._draw(ctx, n_tokens, rng)
            if sample is not None:
                return sample
        raise ValueError(f"{self.name}: no untied list fits {n_tokens} tokens")

    def _draw(self, ctx: SynthContext, n_tokens: int, rng: random.Random) -> Sample | None:
        """One attempt; None when fitting the list to the budget tied the two counts."""
        frequent = distinct_words(ctx, rng, self.n_frequent)
        more, less = frequent[:2]
        first, second = rng.sample((more, less), 2)
        query = PROMPT.query(f"Which word occurs more often in the list above, {first} or {second}?")
        budget = hs.document_budget(ctx, n_tokens, [query])
        n_items = int(budget / tokens_per_item(ctx, rng, self.sep))
        mean = max(2.0, self.frequent_share * n_items / self.n_frequent)
        top = max(2, round(rng.uniform(0.8, 1.4) * mean))
        counts = {more: top, less: max(1, round(top / rng.uniform(self.min_ratio, self.max_ratio)))}
        for w in frequent[2:]:  # distractors span both asked counts, so either may be "rare" overall
            counts[w] = max(1, round(rng.uniform(0.5 * counts[less], 1.3 * top)))
        n_rare = max(0, (n_items - sum(counts.values())) // self.rare_freq)
        rare = [w for w in rng.sample(ctx.words(), n_rare + len(frequent)) if w not in counts][:n_rare]
        counts.update(dict.fromkeys(rare, self.rare_freq))
        doc = fit_items(ctx, counts, set(frequent), self.sep, budget, rng)
        seen = Counter(doc.split(self.sep))
        if seen[more] <= seen[less]:
            return None
        return Sample(task=self.name, document=doc, query=query, answers=(more,), target=PROMPT.target((more,)))


def distinct_words(ctx: SynthContext, rng: random.Random, n: int) -> list[str]:
    """`n` different words of the split, none a substring of another (so a string-match score
    cannot credit the wrong one)."""
    out: list[str] = []
    for w in rng.sample(ctx.words(), 8 * n):
        if all(w not in o and o not in w for o in out):
            out.append(w)
            if len(out) == n:
                return out
    raise ValueError(f"could not draw {n} words that do not contain each other")
