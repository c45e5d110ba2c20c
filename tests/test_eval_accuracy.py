"""The accuracy harness: cells, scoring, read fractions, JSON and table output."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import KVClient
from lab.eval.accuracy import EvalSpec, run_eval, summary, table


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
    assert res["samples"] == 4 and "scores" not in res["rows"][0]
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
