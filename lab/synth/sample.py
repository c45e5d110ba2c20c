"""What a generator returns: an evaluation sample, or a multi-question training episode."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One task instance: a document, one query, the gold strings, the trained completion."""

    task: str
    document: str
    query: str
    answers: tuple[str, ...]
    target: str

    def score(self, prediction: str) -> float:
        """RULER's string-match-all: the fraction of gold strings found in the prediction."""
        return ruler_score(prediction, self.answers)

    def episode(self, aggregation: bool = False) -> Episode:
        """This sample as a one-question training episode."""
        return Episode(document=self.document, turns=((self.query, self.target),), aggregation=aggregation)


@dataclass(frozen=True, kw_only=True)
class Episode:
    """A training sequence: document, then (query, target) turns, each target ended by EOS."""

    document: str
    turns: tuple[tuple[str, str], ...]
    lm: bool = False
    """Also train next-token prediction on the document itself."""
    aggregation: bool = False
    """The answers aggregate counts over the document (cwe / fwe / compare): trainers may weight them apart."""


def ruler_score(prediction: str, answers: tuple[str, ...]) -> float:
    """Fraction of `answers` that occur (case-insensitively) in `prediction`."""
    if not answers:
        raise ValueError("a sample needs at least one gold answer")
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)
