"""Whole decode steps over static inputs (``workers.step_graph``): same tokens and counts as the packed step."""

from __future__ import annotations

import threading
from typing import Literal

import pytest
import torch

from store.kvstore import KVStore
from tests.streams import drain_together
from workers.decode_batch import EngineConfig
from workers.engine import DEFAULT_OFFLOAD, Worker
from workers.model import LoadedModel, load_model
from workers.requests import DecodeConfig, GenerationStats, SamplingParams
from workers.step_graph import StepGraphCache

DOCS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike " * 9 + "The code is 4411.",
    "november oscar papa quebec romeo sierra tango uniform victor whiskey " * 12 + "The code is 9071.",
]
QUERIES = [" What is the code?", " Tell me the code, please. The code is"]
# Methods whose decode steps can run static: full, and the page methods under a budget over resident KV.
STATIC_METHODS = ["full", "quest", "topk", "quest+phi", "topk+phi"]


def _worker(store: KVStore, lm: LoadedModel, whole_step: Literal["auto", "off", "eager"]) -> Worker:
    return Worker(store, lm, progress=False, offload=None, engine=EngineConfig(whole_step=whole_step))


def _run(worker: Worker, pids: list[str], method: str, n_new: int) -> list[GenerationStats]:
    """Both generations at once (one step serves both), to the end."""
    stats = [GenerationStats() for _ in pids]
    streams = [worker.generate(pid, q, SamplingParams(max_new_tokens=n_new), method=method,
                               decode=DecodeConfig(budget=None if method == "full" else 0.3), stats=s)
               for pid, q, s in zip(pids, QUERIES[: len(pids)], stats, strict=True)]
    drain_together(streams)
    return stats


@pytest.mark.parametrize("method", STATIC_METHODS)
def test_static_steps_give_the_packed_steps_tokens_and_reads(store: KVStore, endless_lm: LoadedModel,
                                                              method: str) -> None:
    off, static = _worker(store, endless_lm, "off"), _worker(store, endless_lm, "eager")
    pids = [off.prefill(d).prefix_id for d in DOCS]
    want = _run(off, pids, method, n_new=10)
    got = _run(static, pids, method, n_new=10)
    graphs = static.engine._graphs
    assert graphs is not None and graphs.captures >= 1 and graphs.replays >= 5  # the static path really ran
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 10
        assert w.extra["graph_steps"] == 0 and g.extra["graph_steps"] >= 5
        assert g.bytes_fetched == w.bytes_fetched and g.prefix_tokens_per_step == w.prefix_tokens_per_step
    assert len(graphs) == 0  # the finished generations' steps are not kept


def test_a_generation_outgrowing_its_own_buffer_gets_a_new_static_step(store: KVStore,
                                                                        endless_lm: LoadedModel) -> None:
    off, static = _worker(store, endless_lm, "off"), _worker(store, endless_lm, "eager")
    pids = [off.prefill(d).prefix_id for d in DOCS[:1]]
    n_new = 90  # beyond the buffer's first room (query + 64 tokens): it grows mid-generation
    want = _run(off, pids, "quest", n_new)
    got = _run(static, pids, "quest", n_new)
    assert got[0].token_ids == want[0].token_ids and len(got[0].token_ids) == n_new
    graphs = static.engine._graphs
    assert graphs is not None and graphs.captures >= 2


def test_a_batch_is_captured_only_when_it_repeats(store: KVStore, endless_lm: LoadedModel) -> None:
    # Step 1 feeds the query, step 2 is the eager warm-up step, step 3 is the first that could run static but
    # its batch is new; step 4 repeats step 3's batch: captured there, not before; later steps replay it.
    for n_new, captures in ((3, 0), (4, 1), (6, 1)):
        worker = _worker(store, endless_lm, "eager")
        pids = [worker.prefill(d).prefix_id for d in DOCS[:1]]
        _run(worker, pids, "full", n_new=n_new)
        graphs = worker.engine._graphs
        assert graphs is not None and graphs.captures == captures, n_new
        assert graphs.replays == max(0, n_new - 4)


def test_a_failed_capture_leaves_its_batch_eager_and_enough_of_them_stop_capturing() -> None:
    class Broken(torch.nn.Module):
        def forward(self, **_: object) -> None:
            raise RuntimeError("cannot be captured")

    # On a CPU the capture itself fails (no CUDA graphs), like a batch whose capture breaks on a GPU.
    cache = StepGraphCache(Broken(), torch.device("cpu"), capture=True)
    for i, key in enumerate(["a", "b", "c"]):
        assert cache.step(key, []) is None  # a new batch: not captured yet
        assert cache.step(key, []) is None and cache.failures == i + 1  # its capture failed: eager
        assert cache.step(key, []) is None and cache.failures == i + 1  # not retried
        assert cache.failed == (i == 2)
    cache.step("d", [])
    assert cache.step("d", []) is None and cache.failures == 3  # no capture tried once failed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", STATIC_METHODS)
@pytest.mark.parametrize("offload", ["default", "none"])
def test_cuda_graphed_steps_give_the_eager_steps_tokens_and_reads(store: KVStore, tiny_model_dir, method: str,
                                                                   offload: str) -> None:
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    tiers = None if offload == "none" else DEFAULT_OFFLOAD
    off = Worker(store, lm, progress=False, offload=tiers, engine=EngineConfig(whole_step="off"))
    graphed = Worker(store, lm, progress=False, offload=tiers, engine=EngineConfig(whole_step="auto"))
    pids = [off.prefill(d).prefix_id for d in DOCS]
    want = _run(off, pids, method, n_new=12)
    got = _run(graphed, pids, method, n_new=12)
    graphs = graphed.engine._graphs
    assert graphs is not None and not graphs.failed and graphs.replays >= 1
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.bytes_fetched == w.bytes_fetched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_capture_on_another_thread_than_the_eager_steps_replays(store: KVStore, endless_model_dir) -> None:
    """The engine steps on the thread pulling a stream: here the eager steps run on this thread and the capture
    on a fresh one, as when a server's request thread takes the turn. (On the H100 this passed with and
    without creating the thread's cuBLAS handles before the capture; the handle failure that change fixes
    was seen only under the worker server, in bench/bench_fairness.py.)"""
    lm = load_model(str(endless_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    worker = Worker(store, lm, progress=False, offload=None, engine=EngineConfig(whole_step="auto"))
    pid = worker.prefill(DOCS[0]).prefix_id  # the model never ends an answer early
    stats = GenerationStats()
    gen = worker.generate(pid, "Q", SamplingParams(max_new_tokens=12), method="full", raw=True, stats=stats)
    while stats.steps < 3:  # the query's forward, the first single step, the first step of the batch's key
        next(gen)
    rest: list[object] = []
    t = threading.Thread(target=lambda: rest.extend(gen))
    t.start()
    t.join()
    graphs = worker.engine._graphs
    assert graphs is not None
    assert graphs.failures == 0 and graphs.captures == 1 and graphs.replays >= 1
    assert stats.new_tokens == 12
