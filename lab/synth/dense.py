"""Training-only episodes: dense-supervision recall (many needles, many questions) and plain text."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lab.synth import haystack as hs
from lab.synth.context import SynthContext
from lab.synth.format import PROMPT
from lab.synth.niah import (
    HaystackKind,
    KeyKind,
    ValueKind,
    make_key,
    make_value,
    needle_text,
    question_text,
    stream,
)
from lab.synth.sample import Episode
from lab.synth.values import distinct

VALUE_KINDS: tuple[ValueKind, ...] = ("number", "number", "word", "uuid")
HAYSTACKS: tuple[HaystackKind, ...] = ("noise", "text", "text", "needles")
MULTI_VALUE_P = 0.2
MULTI_QUERY_P = 0.15
UUID_KEY_P = 0.15
MAX_QA_SHARE = 0.4
MAX_ATTEMPTS = 8
"""Questions and answers take at most this share of the sequence (the first always fits)."""


def questions(rng: random.Random, keys: list[str], values: dict[str, list[str]], kind, n: int):
    """Up to `n` (question, answers) pairs over random keys: single, multi-value or multi-query."""
    order = rng.sample(keys, len(keys))
    out: list[tuple[str, list[str]]] = []
    while order and len(out) < n:
        if rng.random() < MULTI_QUERY_P and len(order) >= 2:
            asked = [order.pop() for _ in range(min(len(order), rng.randint(2, 4)))]
        else:
            asked = [order.pop()]
        every = len(asked) > 1 or len(values[asked[0]]) > 1
        out.append((question_text(kind, asked, every), [v for k in asked for v in values[k]]))
    return out


@dataclass(frozen=True, kw_only=True)
class DenseRecall:
    """Many key-value needles in one haystack, then many questions, each answer supervised."""

    name: str = "dense_recall"
    tokens_per_needle: int = 192
    max_needles: int = 96
    max_questions: int = 24

    def episode(self, ctx: SynthContext, n_tokens: int, seed: int) -> Episode:
        """One episode whose whole sequence (document, questions, answers) fits `n_tokens`."""
        rng = ctx.rng(self.name, n_tokens, seed)
        n_keys = max(2, min(self.max_needles, n_tokens // self.tokens_per_needle))
        n_keys = rng.randint(max(1, n_keys // 4), n_keys)
        for _ in range(MAX_ATTEMPTS):
            ep, used = self.build(ctx, rng, n_keys, n_tokens)
            if used <= n_tokens:
                return ep
            n_keys = max(1, n_keys // 2)
        raise ValueError(f"no dense-recall episode fits {n_tokens} tokens")

    def build(self, ctx: SynthContext, rng: random.Random, n_keys: int, n_tokens: int) -> tuple[Episode, int]:
        """An episode with `n_keys` keys, and the tokens its sequence takes."""
        vocab = ctx.words()
        kind = rng.choice(VALUE_KINDS)
        key_kind: KeyKind = "uuid" if rng.random() < UUID_KEY_P else "words"
        keys = distinct(make_key, n_keys, rng, key_kind, vocab)
        n_vals = [rng.randint(2, 4) if rng.random() < MULTI_VALUE_P else 1 for _ in keys]
        flat = distinct(make_value, sum(n_vals), rng, kind, vocab)
        owners = [k for k, n in zip(keys, n_vals) for _ in range(n)]
        depths = [rng.random() for _ in flat]
        values: dict[str, list[str]] = {k: [] for k in keys}
        for _, k, v in sorted(zip(depths, owners, flat)):
            values[k].append(v)
        turns: list[tuple[str, str]] = []
        used = ctx.special_tokens
        for q, a in questions(rng, keys, values, kind, self.max_questions):
            turn = (PROMPT.query(q), PROMPT.target(a))
            cost = ctx.count(turn[0]) + ctx.count(turn[1]) + 1  # + 1: the answer's </s>
            if turns and used + cost > n_tokens * MAX_QA_SHARE:
                break
            turns.append(turn)
            used += cost
        needles = [needle_text(kind, k, v) for k, v in zip(owners, flat)]

        def distractor() -> str:
            key = keys[0]
            while key in values:
                key = make_key(rng, key_kind, vocab)
            return needle_text(kind, key, make_value(rng, kind, vocab))

        units = stream(ctx, rng, rng.choice(HAYSTACKS), distractor)
        doc = hs.fit(ctx, units, needles, depths, n_tokens - used)
        return Episode(document=doc, turns=tuple(turns)), used + ctx.count(doc)


@dataclass(frozen=True, kw_only=True)
class PlainText:
    """Next-token prediction on the training text (no questions)."""

    name: str = "plain_text"

    def episode(self, ctx: SynthContext, n_tokens: int, seed: int) -> Episode:
        """A natural-text passage of about `n_tokens` tokens."""
        rng = ctx.rng(self.name, n_tokens, seed)
        doc = hs.fit(ctx, hs.text_stream(ctx, rng), [], [], n_tokens - ctx.special_tokens)
        return Episode(document=doc, turns=(), lm=True)
