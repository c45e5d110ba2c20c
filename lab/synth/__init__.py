"""Deterministic, seeded RULER-style long-context tasks (see registry.TASKS)."""

from lab.synth.context import SynthContext
from lab.synth.format import PROMPT, PromptFormat
from lab.synth.registry import NIAH_TASKS, TASKS, generate
from lab.synth.sample import Episode, Sample, ruler_score

__all__ = [
    "NIAH_TASKS",
    "PROMPT",
    "TASKS",
    "Episode",
    "PromptFormat",
    "Sample",
    "SynthContext",
    "generate",
    "ruler_score",
]
