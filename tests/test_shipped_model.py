"""The shipped model answers held-out retrieval questions through the product's own path."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import KVClient
from lab.eval.accuracy import EvalSpec, run_eval
from store.errors import InvalidInput
from workers.model_source import SHIPPED_MODEL_NAME, SHIPPED_MODELS_DIR

MODEL = SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> KVClient:
    assert (MODEL / "config.json").is_file(), f"the trained model must ship in {MODEL}"
    return KVClient(home=tmp_path_factory.mktemp("shipped"), model=str(MODEL), device="cpu", progress=False)


def test_default_model_is_the_shipped_one(monkeypatch) -> None:
    from workers.model_source import default_model

    monkeypatch.delenv("KVSTASH_MODEL", raising=False)
    assert default_model() == str(MODEL)
    monkeypatch.setenv("KVSTASH_MODEL", "some/hub-id")
    assert default_model() == "some/hub-id"


def test_no_model_is_a_clear_error_not_a_random_one(monkeypatch, tmp_path: Path) -> None:
    import workers.model_source as source

    monkeypatch.delenv("KVSTASH_MODEL", raising=False)
    monkeypatch.setattr(source, "SHIPPED_MODELS_DIR", tmp_path)
    with pytest.raises(InvalidInput, match="KVSTASH_MODEL or pass --model"):
        source.default_model()
    assert list(tmp_path.iterdir()) == []  # nothing was built in its place


def test_shipped_model_retrieves_needles(kv: KVClient) -> None:
    rows = run_eval(kv, EvalSpec(tasks=("niah_single", "niah_multikey"), lengths=(1024,), samples=2,
                                 max_new_tokens=16), progress=False)
    assert [r.accuracy for r in rows] == [1.0, 1.0], rows


def test_query_template_applies_to_plain_questions(kv: KVClient) -> None:
    doc = kv.prefill("The special magic number for amber-lantern is: 4921873. " + "Nothing else happened. " * 40)
    answer = kv.generate("What is the special magic number for amber-lantern mentioned in the provided text?",
                         prefix=doc, max_new_tokens=16).text
    assert "4921873" in answer


def test_greedy_retrieval_survives_a_kvzip_cache_at_half_the_kv(kv: KVClient) -> None:
    doc = kv.prefill("The special magic number for amber-lantern is: 4921873. " + "Nothing else happened. " * 60
                     + "The special magic number for red-river is: 1180254. " + "The day ended quietly. " * 30)
    question = "What is the special magic number for amber-lantern mentioned in the provided text?"
    full = kv.generate(question, prefix=doc, max_new_tokens=16)
    half = kv.generate(question, prefix=doc, max_new_tokens=16, method="kvzip", ratio=0.5)
    assert "4921873" in full.text and half.text == full.text
    assert half.stats.token_ids == full.stats.token_ids
    assert half.stats.bytes_fetched / half.stats.bytes_full == pytest.approx(0.5, abs=0.01)
    stream = kv.generate(question, prefix=doc, max_new_tokens=16, method="streamingllm", ratio=0.5)
    assert "4921873" not in stream.text  # the needle is at the start, outside sinks + recent window: evicted
