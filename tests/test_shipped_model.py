"""The shipped model answers held-out retrieval questions through the product's own path."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import KVClient
from client.config import SHIPPED_MODEL_NAME, SHIPPED_MODELS_DIR
from lab.eval.accuracy import EvalSpec, run_eval

MODEL = SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> KVClient:
    assert (MODEL / "config.json").is_file(), f"the trained model must ship in {MODEL}"
    return KVClient(home=tmp_path_factory.mktemp("shipped"), model=str(MODEL), device="cpu", progress=False)


def test_default_model_is_the_shipped_one(monkeypatch, tmp_path: Path) -> None:
    from client.config import default_model

    monkeypatch.delenv("KVSTASH_MODEL", raising=False)
    assert default_model(tmp_path) == str(MODEL)


def test_shipped_model_retrieves_needles(kv: KVClient) -> None:
    rows = run_eval(kv, EvalSpec(tasks=("niah_single", "niah_multikey"), lengths=(1024,), samples=2,
                                 max_new_tokens=16), progress=False)
    assert [r.accuracy for r in rows] == [1.0, 1.0], rows


def test_query_template_applies_to_plain_questions(kv: KVClient) -> None:
    doc = kv.prefill("The special magic number for amber-lantern is: 4921873. " + "Nothing else happened. " * 40)
    answer = kv.generate("What is the special magic number for amber-lantern mentioned in the provided text?",
                         prefix=doc, max_new_tokens=16).text
    assert "4921873" in answer
