"""Needle-in-a-haystack tasks (RULER's single, multi-key, multi-value, multi-query)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from lab.synth import haystack as hs
from lab.synth.context import SynthContext
from lab.synth.format import PROMPT
from lab.synth.sample import Sample
from lab.synth.values import distinct, number_value, uuid_value, word_key

ValueKind = Literal["number", "word", "uuid"]
KeyKind = Literal["words", "uuid"]
HaystackKind = Literal["noise", "text", "needles"]


def make_value(rng: random.Random, kind: ValueKind, vocab: tuple[str, ...]) -> str:
    """One needle value of the given kind."""
    if kind == "number":
        return number_value(rng)
    if kind == "uuid":
        return uuid_value(rng)
    return rng.choice(vocab)


def make_key(rng: random.Random, kind: KeyKind, vocab: tuple[str, ...]) -> str:
    """One needle key of the given kind."""
    return uuid_value(rng) if kind == "uuid" else word_key(rng, vocab)


def needle_text(kind: ValueKind, key: str, value: str) -> str:
    """The sentence that hides one value."""
    return f"One of the special magic {kind}s for {key} is: {value}."


def question_text(kind: ValueKind, keys: list[str], every: bool) -> str:
    """A question for one key, or (every=True) for all values of one or more keys."""
    if not every:
        return f"What is the special magic {kind} for {keys[0]} mentioned in the provided text?"
    listed = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]
    return f"What are all the special magic {kind}s for {listed} mentioned in the provided text?"


def stream(ctx: SynthContext, rng: random.Random, kind: HaystackKind, distractor) -> hs.Stream:
    """The haystack units of one kind; `distractor()` makes a needle sentence for 'needles'."""
    if kind == "noise":
        return hs.noise_stream()
    if kind == "text":
        return hs.text_stream(ctx, rng)
    return hs.generated_stream(distractor)


@dataclass(frozen=True, kw_only=True)
class Niah:
    """A needle-in-a-haystack task; the defaults are RULER's niah_single_2."""

    name: str
    haystack: HaystackKind = "text"
    key: KeyKind = "words"
    value: ValueKind = "number"
    n_keys: int = 1
    """Needles with distinct keys, the queried ones included (the rest are distractors)."""
    n_values: int = 1
    """Values hidden for each queried key."""
    n_queries: int = 1
    """Keys asked about in the one question."""

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt (document + query) has at most `n_tokens` tokens."""
        rng = ctx.rng(self.name, n_tokens, seed)
        vocab = ctx.words()
        keys = distinct(make_key, max(self.n_keys, self.n_queries), rng, self.key, vocab)
        n_vals = [self.n_values if i < self.n_queries else 1 for i in range(len(keys))]
        values = distinct(make_value, sum(n_vals), rng, self.value, vocab)
        owners = [k for k, n in zip(keys, n_vals) for _ in range(n)]
        depths = [rng.random() for _ in values]
        needles = [needle_text(self.value, k, v) for k, v in zip(owners, values)]
        asked = keys[: self.n_queries]
        every = self.n_values > 1 or self.n_queries > 1
        in_doc_order = sorted(zip(depths, owners, values))
        answers = tuple(v for k in asked for _, owner, v in in_doc_order if owner == k)
        query = PROMPT.query(question_text(self.value, asked, every))

        def distractor() -> str:
            key = keys[0]
            while key in keys:
                key = make_key(rng, self.key, vocab)
            return needle_text(self.value, key, make_value(rng, self.value, vocab))

        units = stream(ctx, rng, self.haystack, distractor)
        doc = hs.fit(ctx, units, needles, depths, hs.document_budget(ctx, n_tokens, [query]))
        return Sample(task=self.name, document=doc, query=query, answers=answers, target=PROMPT.target(answers))
