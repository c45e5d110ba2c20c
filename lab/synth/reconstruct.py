"""Reconstruction: repeat the whole document (KVzip-style scoring needs a model that copies)."""

from __future__ import annotations

from dataclasses import dataclass

from lab.synth import haystack as hs
from lab.synth.context import SynthContext
from lab.synth.format import PROMPT
from lab.synth.sample import Sample

QUESTION = PROMPT.repeat_question


@dataclass(frozen=True, kw_only=True)
class Repeat:
    """A single-paragraph natural-text document; the answer is the document itself.

    Gold strings are its sentences, so the score is the fraction reproduced verbatim.
    """

    name: str

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt has at most `n_tokens` tokens."""
        rng = ctx.rng(self.name, n_tokens, seed)
        query = PROMPT.query(QUESTION)
        budget = hs.document_budget(ctx, n_tokens, [query])
        doc, units = hs.fit_units(ctx, hs.text_stream(ctx, rng, newlines=False), [], [], budget)
        answers = tuple(u.strip() for u in units)
        return Sample(task=self.name, document=doc, query=query, answers=answers, target=PROMPT.answer_prefix + doc)
