"""Accuracy of the synthetic task suite per task x context length x method x budget."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from lab.eval.target import EvalTarget
from workers.requests import QUERY_PAGES

EVAL_SEED_BASE = 100_000
"""Eval samples use seeds from here on (training uses other seeds and the train split)."""


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

    def __post_init__(self) -> None:
        if (self.samples < 1 or not self.tasks or not self.lengths or not self.methods or not self.budgets
                or not self.budget_tokens or not self.ratios):
            raise ValueError("need at least one task, length, method, budget, budget tokens, ratio and sample")


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


def run_eval(client: EvalTarget, spec: EvalSpec, progress: bool = True) -> list[EvalRow]:
    """Score every (task, length, method, budget) cell; each sample is prefilled once and reused."""
    from lab.synth import SynthContext, generate
    from workers.methods.registry import compression_methods

    ctx = SynthContext(tokenizer=client.worker.lm.tokenizer, split="eval")
    compressing = set(compression_methods())
    combos = [(m, b, bt, r) for m in spec.methods for b in spec.budgets for bt in spec.budget_tokens
              for r in (spec.ratios if m in compressing else (None,))]
    scores: dict[tuple[str, int, str, float | None, int | None, float | None], list[float]] = {}
    reads: dict[tuple[str, int, str, float | None, int | None, float | None], list[float]] = {}
    total = len(spec.tasks) * len(spec.lengths) * spec.samples
    bar = tqdm(total=total, desc="eval", unit="sample", disable=not progress)
    for task, length in _cells(spec):
        for i in range(spec.samples):
            bar.set_postfix_str(f"{task} at {length} tokens, sample {i + 1}/{spec.samples}", refresh=True)
            sample = generate(task, length, EVAL_SEED_BASE + i, ctx)
            handle = client.prefill(sample.document)
            for method, budget, budget_tokens, ratio in combos:
                gen = client.generate(sample.query, prefix=handle.prefix_id, method=method, budget=budget, raw=True,
                                      max_new_tokens=spec.max_new_tokens, gen_len=spec.gen_len,
                                      budget_tokens=budget_tokens, ratio=ratio, query_pages=spec.query_pages)
                key = (task, length, method, budget, budget_tokens, ratio)
                scores.setdefault(key, []).append(sample.score(gen.text))
                st = gen.stats
                reads.setdefault(key, []).append(st.bytes_fetched / st.bytes_full if st.bytes_full else 0.0)
            bar.update(1)
    bar.close()
    return [EvalRow(task=t, length=n, method=m, budget=b, budget_tokens=bt, ratio=r, samples=len(s),
                    accuracy=statistics.fmean(s), read_fraction=statistics.fmean(reads[(t, n, m, b, bt, r)]),
                    scores=s)
            for (t, n, m, b, bt, r), s in scores.items()]


def summary(rows: Sequence[EvalRow]) -> dict[str, Any]:
    """JSON-ready result: overall accuracy plus every row."""
    all_scores = [x for r in rows for x in r.scores]
    return {"accuracy": statistics.fmean(all_scores) if all_scores else 0.0, "samples": len(all_scores),
            "rows": [{k: v for k, v in asdict(r).items() if k != "scores"} for r in rows]}


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
