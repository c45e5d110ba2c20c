"""Accuracy of the synthetic task suite per task x context length x method x budget."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from lab.eval.target import Answer, EvalTarget
from workers.requests import QUERY_PAGES

EVAL_SEED_BASE = 100_000
"""Eval samples use seeds from here on (training uses other seeds and the train split)."""
EVAL_CONCURRENCY_DEFAULT = 8
"""Generations an eval keeps in flight unless told (``EvalSpec.concurrency``)."""
EVAL_CONCURRENCY_MAX = 256
"""Most generations an eval keeps in flight (each holds its own KV for the query and answer)."""


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """What to evaluate."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    methods: tuple[str, ...] = ("full",)
    budgets: tuple[float | None, ...] = (None,)
    budget_tokens: tuple[int | None, ...] = (None,)
    """Kept entries per KV head of query-time caches (snapkv, lookahead)."""
    ratios: tuple[float | None, ...] = (None,)
    """Kept fractions of the compression methods' caches (other methods ignore them and run once)."""
    samples: int = 20
    max_new_tokens: int = 48
    gen_len: int = 1
    """L_gen for budget matching (appendix D): 1 charges a one-time φ fetch to a single step."""
    query_pages: str = QUERY_PAGES[0]
    """``DecodeConfig.query_pages`` of every generation."""
    concurrency: int = EVAL_CONCURRENCY_DEFAULT
    """Generations in flight at once, advanced together by the worker's engine (batched steps; the same tokens
    as one at a time): a sample's cells, and as many samples' as fit."""

    def __post_init__(self) -> None:
        if (self.samples < 1 or not self.tasks or not self.lengths or not self.methods or not self.budgets
                or not self.budget_tokens or not self.ratios):
            raise ValueError("need at least one task, length, method, budget, budget tokens, ratio and sample")
        if not 1 <= self.concurrency <= EVAL_CONCURRENCY_MAX:
            raise ValueError(f"concurrency must be 1 to {EVAL_CONCURRENCY_MAX}")


@dataclass(frozen=True, kw_only=True)
class EvalRow:
    """One cell of the accuracy table."""

    task: str
    length: int
    method: str
    budget: float | None
    budget_tokens: int | None = None
    samples: int
    ratio: float | None = None
    accuracy: float
    """Mean RULER score (fraction of gold strings found), 0..1."""
    read_fraction: float
    """Prefix bytes read / bytes exact attention would read, averaged over samples."""
    scores: list[float] = field(default_factory=list, repr=False)


def _cells(spec: EvalSpec) -> Iterator[tuple[str, int]]:
    for task in spec.tasks:
        for length in spec.lengths:
            yield task, length


Key = tuple[str, int, str, float | None, int | None, float | None]
"""A cell: task, length, method, budget, budget tokens, ratio."""
Combo = tuple[str, float | None, int | None, float | None]
"""What one generation of a sample runs: method, budget, budget tokens, ratio."""


def run_eval(client: EvalTarget, spec: EvalSpec, progress: bool = True,
             on_rows: Callable[[list[EvalRow]], None] | None = None) -> list[EvalRow]:
    """Score every (task, length, method, budget) cell; each sample is prefilled once and reused. ``on_rows``
    gets the rows so far after each group of samples (a long run that is stopped keeps what it measured)."""
    from lab.synth import SynthContext, generate
    from workers.methods.full import FullAttention
    from workers.methods.registry import compression_methods

    ctx = SynthContext(tokenizer=client.worker.lm.tokenizer, split="eval")
    compressing = set(compression_methods())
    combos: list[Combo] = list(dict.fromkeys(  # full attention ignores budgets: one cell, not one per budget
        (m, None, None, None) if m == FullAttention.name else (m, b, bt, r)
        for m in spec.methods for b in spec.budgets for bt in spec.budget_tokens
        for r in (spec.ratios if m in compressing else (None,))))
    scores: dict[Key, list[float]] = {}
    reads: dict[Key, list[float]] = {}
    total = len(spec.tasks) * len(spec.lengths) * spec.samples
    bar = tqdm(total=total, desc="eval", unit="sample", disable=not progress)
    group = max(1, spec.concurrency // len(combos))  # samples prefilled before their generations start together
    for task, length in _cells(spec):
        for first in range(0, spec.samples, group):
            last = min(first + group, spec.samples)
            bar.set_postfix_str(f"{task} at {length} tokens, samples {first + 1}-{last}/{spec.samples}", refresh=True)
            jobs = []
            for i in range(first, last):
                sample = generate(task, length, EVAL_SEED_BASE + i, ctx)
                prefix = client.prefill(sample.document).prefix_id
                jobs += [(sample, prefix, combo) for combo in combos]
            for start in range(0, len(jobs), spec.concurrency):
                chunk = jobs[start:start + spec.concurrency]
                answers = _answer_together(client, spec, [(s.query, p, c) for s, p, c in chunk])
                for (sample, _, (method, budget, budget_tokens, ratio)), gen in zip(chunk, answers, strict=True):
                    key = (task, length, method, budget, budget_tokens, ratio)
                    scores.setdefault(key, []).append(sample.score(gen.text))
                    st = gen.stats
                    reads.setdefault(key, []).append(st.bytes_fetched / st.bytes_full if st.bytes_full else 0.0)
            bar.update(last - first)
            if on_rows is not None:
                on_rows(_rows(scores, reads))
    bar.close()
    return _rows(scores, reads)


def _answer_together(client: EvalTarget, spec: EvalSpec, asks: Sequence[tuple[str, str, Combo]]) -> list[Answer]:
    """The finished answers to ``asks`` (query, prefix, combo), each started while the ones before it decode, so
    an engine step advances all of them; on an error the ones started are closed."""
    from workers.engine import drain_together
    from workers.methods.full import FullAttention

    gens: list[Answer] = []
    pieces: list[Iterator[str]] = []
    try:
        for query, prefix, (method, budget, budget_tokens, ratio) in asks:
            gen = client.generate(query, prefix=prefix, method=method, raw=True,
                                  budget=None if method == FullAttention.name else budget,  # full reads all: no budget
                                  max_new_tokens=spec.max_new_tokens, gen_len=spec.gen_len,
                                  budget_tokens=budget_tokens, ratio=ratio, query_pages=spec.query_pages)
            gens.append(gen)
            it = iter(gen)
            # Its first piece before the next one starts: each query gets a step of its own, as alone (queries
            # sharing a step's token budget may be split over two steps, which reads more), while the answers
            # already started decode in the same steps.
            with contextlib.suppress(StopIteration):
                next(it)
                pieces.append(it)
        drain_together(pieces)
    except BaseException:
        for gen in gens:  # the answers themselves: closing their iterators would not end the generations
            with contextlib.suppress(Exception):  # the error in hand is the one to report
                gen.close()
        raise
    return gens


def _rows(scores: dict[Key, list[float]], reads: dict[Key, list[float]]) -> list[EvalRow]:
    return [EvalRow(task=t, length=n, method=m, budget=b, budget_tokens=bt, ratio=r, samples=len(s),
                    accuracy=statistics.fmean(s), read_fraction=statistics.fmean(reads[(t, n, m, b, bt, r)]),
                    scores=list(s))
            for (t, n, m, b, bt, r), s in scores.items()]


def summary(rows: Sequence[EvalRow]) -> dict[str, Any]:
    """JSON-ready result: overall accuracy plus every row, with its per-sample scores in sample order (the same
    samples in every cell of a task and length, so two methods compare sample by sample)."""
    all_scores = [x for r in rows for x in r.scores]
    return {"accuracy": statistics.fmean(all_scores) if all_scores else 0.0, "samples": len(all_scores),
            "rows": [asdict(r) for r in rows]}


def table(rows: Sequence[EvalRow]) -> str:
    """A Markdown table of the rows."""
    out = ["| task | length | method | budget | budget tokens | ratio | samples | accuracy | read fraction |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = "-" if r.budget is None else f"{r.budget:g}"
        bt = "-" if r.budget_tokens is None else str(r.budget_tokens)
        c = "-" if r.ratio is None else f"{r.ratio:g}"
        out.append(f"| {r.task} | {r.length} | {r.method} | {b} | {bt} | {c} | {r.samples} | {r.accuracy:.3f} | "
                   f"{r.read_fraction:.3f} |")
    return "\n".join(out)
