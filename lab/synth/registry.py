"""Registry of evaluation tasks (task name -> generator) and the one entry point `generate`."""

from __future__ import annotations

from typing import Protocol

from lab.synth.aggregate import CommonWords, FrequentWords, WordCompare
from lab.synth.context import SynthContext
from lab.synth.niah import Niah
from lab.synth.reconstruct import Repeat
from lab.synth.sample import Sample
from lab.synth.tracking import VariableTracking


class Task(Protocol):
    """A task generator: `make` returns one seeded sample fitted to a token count."""

    @property
    def name(self) -> str: ...

    def make(self, ctx: SynthContext, n_tokens: int, seed: int) -> Sample: ...


_TASK_LIST: tuple[Task, ...] = (
    Niah(name="niah_single"),
    Niah(name="niah_single_noise", haystack="noise"),
    Niah(name="niah_single_word", value="word"),
    Niah(name="niah_single_uuid", value="uuid"),
    Niah(name="niah_multikey", n_keys=4),
    Niah(name="niah_multikey_needles", haystack="needles"),
    Niah(name="niah_multikey_uuid", haystack="needles", key="uuid", value="uuid"),
    Niah(name="niah_multivalue", n_values=4),
    Niah(name="niah_multiquery", n_queries=4),
    VariableTracking(name="vt"),
    CommonWords(name="cwe"),
    FrequentWords(name="fwe"),
    WordCompare(name="compare"),
    Repeat(name="repeat"),
)
TASKS: dict[str, Task] = {t.name: t for t in _TASK_LIST}
NIAH_TASKS: tuple[str, ...] = tuple(n for n in TASKS if n.startswith("niah_"))


def generate(task: str, n_tokens: int, seed: int, ctx: SynthContext) -> Sample:
    """Sample `seed` of `task` at `n_tokens` tokens, from the context's split (eval = held out)."""
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task].make(ctx, n_tokens, seed)
