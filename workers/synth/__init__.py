"""Deterministic, seeded RULER-style long-context tasks (see registry.TASKS)."""

from workers.synth.context import SynthContext
from workers.synth.format import PROMPT, PromptFormat
from workers.synth.registry import NIAH_TASKS, TASKS, generate
from workers.synth.sample import Episode, Sample, ruler_score

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
