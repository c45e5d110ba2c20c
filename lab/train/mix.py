"""The training mixture: which episode fills one row of a batch."""

from __future__ import annotations

import random

from lab.synth import TASKS, Episode, SynthContext
from lab.synth.aggregate import CommonWords, FrequentWords, WordCompare
from lab.synth.dense import DenseRecall, PlainText
from lab.synth.reconstruct import Repeat
from lab.synth.registry import Task
from lab.synth.tracking import VariableTracking
from lab.train.config import AggregationMix, MixConfig

RULER_NIAH = tuple(TASKS[n] for n in TASKS if n.startswith("niah_"))
DENSE = DenseRecall()
PLAIN = PlainText()
REPEAT = Repeat(name="repeat")
VT_CHAINS = (1, 1, 2, 3)
VT_HOPS = (1, 2, 3, 4, 4, 5, 6)
NIAH_SHARE = 0.6
"""Of the RULER component: NIAH share; the rest is split between vt and aggregation."""
VT_SHARE = 0.3
RULER_RETRIES = 4
AGGREGATION_TASKS = ("cwe", "fwe", "compare")
COMPARE = WordCompare(name="compare")
RULER_MARGIN = 8


def aggregation_task(rng: random.Random, agg: AggregationMix) -> Task:
    """A compare, cwe or fwe generator (cwe / fwe with their answer count drawn from `agg`)."""
    if rng.random() < agg.compare_share:
        return COMPARE
    if rng.random() < agg.cwe_share:
        return CommonWords(name="cwe", n_common=rng.choice(agg.cwe_common))
    return FrequentWords(name="fwe", n_top=rng.choice(agg.fwe_top))


def ruler_task(rng: random.Random, agg: AggregationMix) -> Task:
    """A RULER-style task, with randomized difficulty for variable tracking and aggregation."""
    r = rng.random()
    if r < NIAH_SHARE:
        return rng.choice(RULER_NIAH)
    if r < NIAH_SHARE + VT_SHARE:
        return VariableTracking(name="vt", n_chains=rng.choice(VT_CHAINS), n_hops=rng.choice(VT_HOPS))
    return aggregation_task(rng, agg)


def episode(ctx: SynthContext, mix: MixConfig, seq_len: int, seed: int) -> Episode:
    """The training episode for one batch row; its whole sequence fits `seq_len` tokens."""
    rng = random.Random(f"mix/{seq_len}/{seed}")
    weights = (mix.dense_recall, mix.ruler, mix.repeat, mix.plain_text, mix.aggregation)
    kind = rng.choices(("dense", "ruler", "repeat", "plain", "aggregation"), weights=weights)[0]
    if kind == "dense":
        return dense_or_plain(ctx, seq_len, seed)
    if kind == "plain":
        return PLAIN.episode(ctx, seq_len, seed)
    if kind == "repeat":
        n = min(mix.max_repeat_tokens, seq_len // 2 - 4)
        return REPEAT.make(ctx, n, seed).episode()
    task = ruler_task(rng, mix.agg) if kind == "ruler" else aggregation_task(rng, mix.agg)
    return fitted(ctx, task, mix, seq_len, seed)


def fitted(ctx: SynthContext, task: Task, mix: MixConfig, seq_len: int, seed: int) -> Episode:
    """`task`'s sample with prompt, answer and </s> within `seq_len` (dense recall if none fits)."""
    n = seq_len - mix.answer_reserve
    for _ in range(RULER_RETRIES):
        try:
            sample = task.make(ctx, n, seed)
        except ValueError:  # too short for the query
            break
        parts = (sample.document, sample.query, sample.target)
        excess = ctx.special_tokens + sum(map(ctx.count, parts)) + 1 - seq_len  # + 1: the answer's </s>
        if excess <= 0:
            return sample.episode(aggregation=task.name in AGGREGATION_TASKS)
        n -= excess + RULER_MARGIN
    return dense_or_plain(ctx, seq_len, seed)  # the task does not fit this length


def dense_or_plain(ctx: SynthContext, seq_len: int, seed: int) -> Episode:
    """A dense-recall episode, or plain text when none fits (very short lengths)."""
    try:
        return DENSE.episode(ctx, seq_len, seed)
    except ValueError:
        return PLAIN.episode(ctx, seq_len, seed)
