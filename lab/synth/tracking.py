"""Variable tracking (RULER): chains of assignments hidden in the noise haystack."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lab.synth import haystack as hs
from lab.synth.context import SynthContext
from lab.synth.format import PROMPT
from lab.synth.sample import Sample
from lab.synth.values import distinct, variable_name

VALUE_DIGITS = 5


def chain(rng: random.Random, names: list[str]) -> tuple[str, list[str]]:
    """A value and the statements that pass it along `names` in order."""
    value = str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))
    statements = [f"VAR {names[0]} = {value} ."]
    statements += [f"VAR {b} = VAR {a} ." for a, b in zip(names, names[1:])]
    return value, statements


def question(value: str) -> str:
    """The question asking for every variable that ends up holding `value`."""
    return f"Find all variables that are assigned the value {value} in the text above."


@dataclass(frozen=True, kw_only=True)
class VariableTracking:
    """RULER's vt: `n_chains` chains of `n_hops` assignments; the first chain is asked about."""

    name: str
    n_chains: int = 1
    n_hops: int = 4

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample:
        """One sample whose prompt has at most `n_tokens` tokens; answers in chain order."""
        rng = ctx.rng(self.name, n_tokens, seed)
        names = distinct(variable_name, self.n_chains * (self.n_hops + 1), rng)
        needles: list[str] = []
        depths: list[float] = []
        gold_value, gold_names = "", names[: self.n_hops + 1]
        for c in range(self.n_chains):
            value, statements = chain(rng, names[c * (self.n_hops + 1) : (c + 1) * (self.n_hops + 1)])
            gold_value = gold_value or value
            needles += statements
            depths += sorted(rng.random() for _ in statements)
        query = PROMPT.query(question(gold_value))
        budget = hs.document_budget(ctx, n_tokens, [query])
        doc = hs.fit(ctx, hs.noise_stream(), needles, depths, budget)
        answers = tuple(gold_names)
        return Sample(task=self.name, document=doc, query=query, answers=answers, target=PROMPT.target(answers))
