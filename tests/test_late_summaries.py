"""Late summaries (``workers.late_summaries``): a prefill commits without the costly ones; they are built from the
stored pages in the background or on first use, byte for byte what the prefill would have stored, once per
prefix, and a failed build leaves the prefix serving every other method."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from store.config import StoreConfig
from store.errors import InvalidInput
from store.kvstore import KVStore
from workers.engine import Worker
from workers.late_summaries import LateSummaries
from workers.methods.doublep import ClusterSummarizer
from workers.methods.phi import PhiSummarizer
from workers.methods.registry import prefill_summarizers
from workers.model import load_model
from workers.requests import DecodeConfig, SamplingParams

DOC = "the quiet river runs past the old stone mill at dawn; the miller counts seven sacks. " * 16
QUERY = "How many sacks does the miller count?"
LATE = {"clusters", "phi", "valueindex"}
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _worker(tmp: Path, lm, policy: str, tag: str) -> Worker:
    store = KVStore(StoreConfig(home=tmp / tag, page_size=16))
    return Worker(store, lm, progress=False, late_summaries=policy)  # type: ignore[arg-type]


def _digests(worker: Worker, pid: str) -> dict[str, str]:
    m = worker.store.manifest(pid)
    return {a.name: a.blake2b for a in m.artifacts}


@pytest.fixture()
def inline(tmp_path: Path, lm) -> tuple[Worker, str]:
    w = _worker(tmp_path, lm, "inline", "inline")
    return w, w.prefill(DOC).prefix_id


def test_the_late_summarizers_are_the_costly_ones() -> None:
    assert {s.name for s in prefill_summarizers() if s.late} == LATE
    assert ClusterSummarizer.late and PhiSummarizer.late


def test_auto_is_on_use_on_the_cpu(tmp_path: Path, lm) -> None:
    w = _worker(tmp_path, lm, "auto", "auto")
    assert w.late.policy == "on_use" and {s.name for s in w.late.deferred()} == LATE
    m = w.prefill(DOC).manifest
    assert not {a.name for a in m.artifacts} & LATE  # a CPU prefill pays for no late summary
    w.late.wait()  # nothing was started in the background either
    assert not {a.name for a in w.store.manifest(m.prefix_id).artifacts} & LATE
    "".join(w.generate(m.prefix_id, QUERY, GREEDY, method="doublep", decode=DecodeConfig(budget=0.25)))
    assert "clusters" in {a.name for a in w.store.manifest(m.prefix_id).artifacts}  # built on first use


def test_a_timed_build_reports_each_part(tmp_path: Path, lm) -> None:
    w = _worker(tmp_path, lm, "on_use", "timed")
    w.late.timed = True
    m = w.prefill(DOC).manifest
    assert w.late.parts == {}
    w.late.ensure(m)
    assert set(w.late.parts) == LATE | {"read"} and all(s > 0 for s in w.late.parts.values())
    assert sum(w.late.parts.values()) <= next(iter(w.late.seconds.values()))  # parts of the build's wall time


def test_on_use_builds_only_what_a_method_reads_and_the_same_bytes(tmp_path: Path, lm, inline) -> None:
    ref, ref_pid = inline
    w = _worker(tmp_path, lm, "on_use", "on_use")
    m = w.prefill(DOC).manifest
    names = {a.name for a in m.artifacts}
    assert not LATE & names and {"bounds", "keyindex", "block_means"} <= names
    assert m.prefix_id == ref_pid  # the prefix key does not depend on when its summaries are built
    "".join(w.generate(m.prefix_id, QUERY, GREEDY, method="quest", decode=DecodeConfig(budget=0.25)))
    assert w.late.builds == 0 and not LATE & set(_digests(w, m.prefix_id))  # Quest reads no late summary
    "".join(w.generate(m.prefix_id, QUERY, GREEDY, method="doublep", decode=DecodeConfig(budget=0.25)))
    got = _digests(w, m.prefix_id)
    assert w.late.builds == 1 and "clusters" in got and "phi" not in got
    "".join(w.generate(m.prefix_id, QUERY, GREEDY, method="topk+phi", decode=DecodeConfig(budget=0.25)))
    got = _digests(w, m.prefix_id)
    assert w.late.builds == 2 and "phi" in got and "valueindex" not in got  # the paper's φ reads no value index
    "".join(w.generate(m.prefix_id, QUERY, GREEDY, method="topk+vi", decode=DecodeConfig(budget=0.25)))
    got, want = _digests(w, m.prefix_id), _digests(ref, ref_pid)
    assert w.late.builds == 3 and got == want  # every artifact byte for byte what the inline prefill stored


@pytest.mark.parametrize("method", ["doublep", "topk+phi", "topk+vi"])
def test_answers_equal_the_inline_prefills(tmp_path: Path, lm, inline, method: str) -> None:
    ref, pid = inline
    w = _worker(tmp_path, lm, "on_use", "on_use")
    w.prefill(DOC)
    a = "".join(ref.generate(pid, QUERY, GREEDY, method=method, decode=DecodeConfig(budget=0.25)))
    b = "".join(w.generate(pid, QUERY, GREEDY, method=method, decode=DecodeConfig(budget=0.25)))
    assert a == b


def test_background_builds_them_after_the_prefill_returns(tmp_path: Path, lm, inline) -> None:
    ref, ref_pid = inline
    w = _worker(tmp_path, lm, "background", "bg")
    assert {s.name for s in w.late.deferred()} == LATE
    pre = w.prefill(DOC)
    assert not LATE & {a.name for a in pre.manifest.artifacts}
    w.late.wait()
    assert _digests(w, pre.prefix_id) == _digests(ref, ref_pid) and w.late.builds == len(LATE)
    w.late.close()


def test_a_cached_prefill_restarts_a_missing_build(tmp_path: Path, lm) -> None:
    w = _worker(tmp_path, lm, "on_use", "x")
    pid = w.prefill(DOC).prefix_id
    bg = Worker(w.store, lm, progress=False, late_summaries="background")
    assert bg.prefill(DOC).cached
    bg.late.wait()
    assert set(_digests(bg, pid)) >= LATE
    bg.late.close()


def test_concurrent_requests_build_once(tmp_path: Path, lm) -> None:
    w = _worker(tmp_path, lm, "on_use", "c")
    m = w.prefill(DOC).manifest
    late = LateSummaries(w.store, lm, policy="on_use")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            late.ensure(m, [ClusterSummarizer])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and late.builds == 1 and "clusters" in _digests(w, m.prefix_id)


def test_a_failed_build_changes_nothing_and_other_methods_still_serve(tmp_path: Path, lm,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker(tmp_path, lm, "on_use", "f")
    pid = w.prefill(DOC).prefix_id

    def broken(self, layer, k, v):  # type: ignore[no-untyped-def]
        if layer == lm.layout.n_layers - 1:
            raise RuntimeError("k-means failed")
        return {"x": torch.zeros(1)}

    monkeypatch.setattr(ClusterSummarizer, "summarize", broken)
    with pytest.raises(RuntimeError, match="k-means failed"):
        "".join(w.generate(pid, QUERY, GREEDY, method="doublep", decode=DecodeConfig(budget=0.25)))
    assert "clusters" not in _digests(w, pid)
    assert "".join(w.generate(pid, QUERY, GREEDY, method="quest", decode=DecodeConfig(budget=0.25)))
    monkeypatch.undo()
    assert "".join(w.generate(pid, QUERY, GREEDY, method="doublep", decode=DecodeConfig(budget=0.25)))
    assert "clusters" in _digests(w, pid)


def test_layers_of_unlike_tensors_are_refused(tmp_path: Path, lm, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker(tmp_path, lm, "on_use", "u")
    pid = w.prefill(DOC).prefix_id
    monkeypatch.setattr(ClusterSummarizer, "summarize", lambda self, layer, k, v: {"x": torch.zeros(layer + 1)})
    with pytest.raises(InvalidInput, match="differ from layer 0"):
        w.late.ensure(w.store.manifest(pid), [ClusterSummarizer])
    assert "clusters" not in _digests(w, pid)


def test_unknown_policy_is_refused(tmp_path: Path, lm) -> None:
    with pytest.raises(ValueError, match="policy"):
        _worker(tmp_path, lm, "later", "p")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_background_answers_equal_inline(tmp_path: Path, tiny_model_dir: Path) -> None:
    cuda_lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    ref = _worker(tmp_path, cuda_lm, "inline", "ref")
    bg = _worker(tmp_path, cuda_lm, "auto", "bg")
    assert bg.late.policy == "background"
    pid = ref.prefill(DOC).prefix_id
    assert bg.prefill(DOC).prefix_id == pid
    for method in ("doublep", "topk+phi", "quest"):  # the first two wait for (or run) the build
        a = "".join(ref.generate(pid, QUERY, GREEDY, method=method, decode=DecodeConfig(budget=0.25)))
        b = "".join(bg.generate(pid, QUERY, GREEDY, method=method, decode=DecodeConfig(budget=0.25)))
        assert a == b, method
    bg.late.close()


def test_one_pass_reads_each_layer_once_through_the_worker_tiers(tmp_path: Path, lm,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.methods.source import PrefixSource

    w = _worker(tmp_path, lm, "on_use", "r")
    pid = w.prefill(DOC).prefix_id
    reads: list[tuple[int, bool]] = []
    real = PrefixSource.whole_layer

    ssd_pages: list[int] = []

    def counted(self, layer, *, step=None):  # type: ignore[no-untyped-def]
        reads.append((layer, self.fetcher is not None))
        before = self.fetcher.stats.total.ssd_pages
        out = real(self, layer, step=step)
        ssd_pages.append(self.fetcher.stats.total.ssd_pages - before)
        return out

    monkeypatch.setattr(PrefixSource, "whole_layer", counted)
    w.late.ensure(w.store.manifest(pid))
    assert reads == [(layer, True) for layer in range(lm.layout.n_layers)]  # every summary from one read each
    assert ssd_pages == [0] * lm.layout.n_layers  # each layer was loaded into the host tier ahead of its read
    assert w.late.builds == len(LATE) and set(_digests(w, pid)) >= LATE


def test_a_summary_another_worker_committed_first_still_leaves_the_others_built(tmp_path: Path, lm,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    w = _worker(tmp_path, lm, "on_use", "race")
    pid = w.prefill(DOC).prefix_id
    other = LateSummaries(w.store, lm, policy="on_use")  # another worker's builder over the same store
    real = w.store.add_artifact
    raced: list[str] = []

    def add_artifact(prefix_id, name, data):  # type: ignore[no-untyped-def]
        if name == "clusters" and not raced:
            raced.append(name)
            other.ensure(w.store.manifest(prefix_id), [ClusterSummarizer])  # it commits first
        return real(prefix_id, name, data)

    monkeypatch.setattr(w.store, "add_artifact", add_artifact)
    m = w.late.ensure(w.store.manifest(pid))
    assert raced and other.builds == 1 and {a.name for a in m.artifacts} >= LATE
    assert w.late.builds == len(LATE) - 1  # the others were this worker's, in a pass of their own


def test_without_an_offload_tier_the_next_layer_is_read_ahead_on_a_thread(tmp_path: Path, lm, inline,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from workers.methods.source import PrefixSource

    ref, ref_pid = inline
    store = KVStore(StoreConfig(home=tmp_path / "bare", page_size=16))
    w = Worker(store, lm, progress=False, offload=None, late_summaries="on_use")
    pid = w.prefill(DOC).prefix_id
    reads: list[tuple[int, str]] = []
    real = PrefixSource.host_layer_kv

    def counted(self, layer):  # type: ignore[no-untyped-def]
        reads.append((layer, threading.current_thread().name))
        return real(self, layer)

    monkeypatch.setattr(PrefixSource, "host_layer_kv", counted)
    w.late.ensure(w.store.manifest(pid))
    assert [layer for layer, _ in reads] == list(range(lm.layout.n_layers))  # each layer read once, in order
    assert all(name.startswith("late-read-ahead") for _, name in reads)  # off the building thread
    assert _digests(w, pid) == _digests(ref, ref_pid)


def test_a_refused_artifact_stops_the_write_ahead_thread_at_once(tmp_path: Path, lm) -> None:
    w = _worker(tmp_path, lm, "on_use", "refused")
    m = w.prefill(DOC).manifest
    real = w.store.add_artifact

    def refuse_after_one_chunk(pid, name, data):
        next(iter(data))  # the producer has started and runs ahead
        raise InvalidInput("quota")

    w.store.add_artifact = refuse_after_one_chunk  # type: ignore[method-assign]
    with pytest.raises(InvalidInput, match="quota"):
        try:
            w.late.ensure(m)
        except InvalidInput:
            # still inside the handler: the traceback holds the build's frames, the producer must be gone already
            assert not [t for t in threading.enumerate() if t.name == "late-summaries-ahead" and t.is_alive()]
            raise
    w.store.add_artifact = real  # type: ignore[method-assign]
    assert "clusters" in {a.name for a in w.late.ensure(m).artifacts}  # a later build succeeds
