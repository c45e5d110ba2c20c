"""The accuracy harness: cells, scoring, read fractions, JSON and table output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from client import KVClient
from lab.eval.accuracy import EVAL_CONCURRENCY_MAX, EvalSpec, run_eval, summary, table


@pytest.fixture()
def kv(tmp_path: Path, tiny_model_dir: Path) -> KVClient:
    return KVClient(home=tmp_path / "home", model=str(tiny_model_dir), device="cpu", progress=False)


def test_eval_cells_and_reuse(kv: KVClient) -> None:
    spec = EvalSpec(tasks=("niah_single", "vt"), lengths=(300,), samples=2, max_new_tokens=4)
    rows = run_eval(kv, spec, progress=False)
    assert [(r.task, r.length, r.method, r.samples) for r in rows] == [("niah_single", 300, "full", 2),
                                                                        ("vt", 300, "full", 2)]
    assert all(0.0 <= r.accuracy <= 1.0 and r.read_fraction == pytest.approx(1.0) for r in rows)  # full reads all
    assert len(kv.ls()) == 4  # one prefix per sample, each prefilled once
    res = summary(rows)
    assert res["samples"] == 4 and [r["scores"] for r in res["rows"]] == [r.scores for r in rows]
    assert all(len(r["scores"]) == 2 for r in res["rows"])
    assert table(rows).count("\n") == 3


def test_eval_spec_validation() -> None:
    with pytest.raises(ValueError):
        EvalSpec(tasks=(), lengths=(100,))
    with pytest.raises(ValueError):
        EvalSpec(tasks=("vt",), lengths=(100,), samples=0)


def test_scores_come_from_the_generated_text(kv: KVClient, monkeypatch) -> None:
    """An oracle that answers with the gold strings scores 1; one that answers nothing scores 0."""
    from client import kvclient

    answers: dict[str, str] = {}
    real_generate = kvclient.KVClient.generate

    class Fixed:
        def __init__(self, text: str, stats):
            self.text, self.stats = text, stats

        def __iter__(self):
            return iter((self.text,))

        def close(self) -> None:
            pass

    def oracle(self, query, prefix=None, **kw):
        g = real_generate(self, query, prefix=prefix, **kw)
        _ = g.text
        return Fixed(answers.get(query, ""), g.stats)

    import lab.synth as synth

    real = synth.generate

    def capture(task, n, seed, ctx):
        s = real(task, n, seed, ctx)
        answers[s.query] = " ".join(s.answers) if seed % 2 == 0 else ""
        return s

    monkeypatch.setattr(synth, "generate", capture)
    monkeypatch.setattr(kvclient.KVClient, "generate", oracle)
    rows = run_eval(kv, EvalSpec(tasks=("niah_single",), lengths=(200,), samples=2, max_new_tokens=2),
                    progress=False)
    assert rows[0].scores == [1.0, 0.0] and rows[0].accuracy == 0.5


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every generation the harness starts, in order."""
    from client import kvclient

    started: list[Any] = []
    real = kvclient.KVClient.generate

    def generate(self, query, prefix=None, **kw):
        g = real(self, query, prefix=prefix, **kw)
        started.append(g)
        return g

    monkeypatch.setattr(kvclient.KVClient, "generate", generate)
    return started


def test_concurrent_eval_batches_and_scores_the_same(kv: KVClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generations in flight together share the engine's steps (batch > 1) and give the same scores and read
    fractions as one at a time; ``on_rows`` sees the rows grow group by group."""
    started = _recording(monkeypatch)
    spec = dict(tasks=("niah_single", "vt"), lengths=(400,), samples=3, max_new_tokens=6,
                methods=("full", "quest", "topk"), budgets=(0.25,))
    alone = run_eval(kv, EvalSpec(**spec, concurrency=1), progress=False)
    assert max(g.stats.extra["batch_max"] for g in started) == 1
    started.clear()
    seen: list[int] = []
    together = run_eval(kv, EvalSpec(**spec, concurrency=7), progress=False,
                        on_rows=lambda rows: seen.append(sum(r.samples for r in rows)))
    assert max(g.stats.extra["batch_max"] for g in started) >= 3  # of two samples' three methods each
    assert seen == [6, 9, 15, 18]  # groups of two samples (3 methods each), per task
    assert [(r.task, r.method, r.scores, r.read_fraction) for r in together] == \
        [(r.task, r.method, r.scores, r.read_fraction) for r in alone]


def test_a_failed_start_closes_the_generations_already_started(kv: KVClient,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """When the third generation of a batch cannot start, the two started before it end at once: nothing runs in
    the engine and no lease holds a prefix."""
    from client import kvclient

    real = kvclient.KVClient.generate
    calls = []

    def third_fails(self, query, prefix=None, **kw):
        calls.append(prefix)
        if len(calls) == 3:
            raise RuntimeError("no third")
        return real(self, query, prefix=prefix, **kw)

    monkeypatch.setattr(kvclient.KVClient, "generate", third_fails)
    with pytest.raises(RuntimeError, match="no third"):
        run_eval(kv, EvalSpec(tasks=("niah_single",), lengths=(300,), samples=1, max_new_tokens=4,
                              methods=("full", "quest", "topk"), budgets=(0.25,), concurrency=3), progress=False)
    assert kv.worker.engine.running() == 0
    assert all(kv.worker.store.leases(p) == [] for p in set(calls))


def test_concurrency_is_bounded() -> None:
    for bad in (0, EVAL_CONCURRENCY_MAX + 1):
        with pytest.raises(ValueError, match="concurrency"):
            EvalSpec(tasks=("vt",), lengths=(100,), concurrency=bad)


def test_full_attention_runs_once_whatever_the_budgets(kv: KVClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full attention ignores budgets: one cell (budget None) and one generation per sample, not one per budget."""
    started = _recording(monkeypatch)
    rows = run_eval(kv, EvalSpec(tasks=("niah_single",), lengths=(300,), samples=2, max_new_tokens=4,
                                 methods=("full", "quest"), budgets=(0.25, 0.5)), progress=False)
    assert [(r.method, r.budget, r.samples) for r in rows] == [("full", None, 2), ("quest", 0.25, 2),
                                                                ("quest", 0.5, 2)]
    assert len(started) == 2 * 3  # per sample: full once, quest at each budget
