"""Prefill summaries beside the forward pass (``workers.prefill_summaries``): the same summaries as inline, errors
raised through the prefill, nothing committed on failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from store.artifacts import bytes_to_tensors
from store.config import StoreConfig
from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods.quest import QuestBounds
from workers.methods.registry import prefill_summarizers
from workers.model import load_model
from workers.prefill_summaries import SummaryLane

DOC = "the quiet river runs past the old stone mill at dawn; " * 24
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _summaries(store: KVStore, pid: str) -> dict[str, dict[str, torch.Tensor]]:
    return {s.name: bytes_to_tensors(store.artifact(pid, s.name)) for s in prefill_summarizers()}


def _assert_same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for t in a[name]:
            x, y = a[name][t], b[name][t]
            assert x.dtype == y.dtype and x.shape == y.shape, (name, t)
            if name == "clusters" and t.endswith(("vsum", "centroids")):
                # float sums of index_add_ (atomics on CUDA): the summation order may differ between runs
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            elif name != "clusters" or t.endswith("meta"):
                assert torch.equal(x, y), (name, t)


def _prefill(tmp: Path, lm, *, beside: bool, tag: str) -> tuple[KVStore, str]:
    store = KVStore(StoreConfig(home=tmp / tag, page_size=16))
    return store, Worker(store, lm, progress=False, summaries_beside=beside,
                         late_summaries="inline").prefill(DOC).prefix_id


def _beside_equals_inline(tmp_path: Path, lm) -> None:
    a, pa = _prefill(tmp_path, lm, beside=True, tag="a")
    b, pb = _prefill(tmp_path, lm, beside=False, tag="b")
    try:
        _assert_same(_summaries(a, pa), _summaries(b, pb))
    finally:
        a.close()
        b.close()


def test_cpu_lane_is_inline_and_stores_every_summary(tmp_path: Path, lm) -> None:
    assert not SummaryLane([], lm.device, beside=True).beside  # no side stream on the CPU: between layers
    _beside_equals_inline(tmp_path, lm)


def _failing(monkeypatch: pytest.MonkeyPatch, at_layer: int) -> None:
    real = QuestBounds.summarize

    def summarize(self, layer, k, v):  # type: ignore[no-untyped-def]
        if layer == at_layer:
            raise RuntimeError("summary failed")
        return real(self, layer, k, v)

    monkeypatch.setattr(QuestBounds, "summarize", summarize)


def _fails_and_commits_nothing(tmp_path: Path, lm, monkeypatch: pytest.MonkeyPatch, *, beside: bool) -> None:
    _failing(monkeypatch, at_layer=lm.layout.n_layers - 1)
    store = KVStore(StoreConfig(home=tmp_path / "f", page_size=16))
    try:
        worker = Worker(store, lm, progress=False, summaries_beside=beside, late_summaries="inline")
        with pytest.raises(RuntimeError, match="summary failed"):
            worker.prefill(DOC)
        assert store.find(worker.prefix_key(worker.tokenize_document(DOC)).prefix_id) is None
    finally:
        store.close()


def test_a_failing_summary_fails_the_prefill_on_cpu(tmp_path: Path, lm, monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_and_commits_nothing(tmp_path, lm, monkeypatch, beside=False)


@pytest.fixture(scope="module")
def cuda_lm(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    return load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)


@CUDA
def test_cuda_summaries_beside_equal_inline(tmp_path: Path, cuda_lm) -> None:
    assert SummaryLane([], cuda_lm.device, beside=True).beside
    _beside_equals_inline(tmp_path, cuda_lm)


@CUDA
def test_cuda_a_failing_summary_beside_fails_the_prefill(tmp_path: Path, cuda_lm,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _fails_and_commits_nothing(tmp_path, cuda_lm, monkeypatch, beside=True)
