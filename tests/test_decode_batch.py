"""The decode engine: batched generations give the tokens they give alone, and fail or stop alone."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from store.errors import Cancelled
from store.kvstore import KVStore
from workers.decode_batch import EngineConfig
from workers.engine import GenerationStream, Worker, drain_together
from workers.methods.quest import QuestBounds
from workers.methods.registry import METHODS, NEEDS_ADAPTER, compression_methods
from workers.methods.shared_state import is_held
from workers.methods.source import PrefixSource
from workers.model import load_model
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOCS = [
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike " * 9 + "The code is 4411.",
    "november oscar papa quebec romeo sierra tango uniform victor whiskey " * 12 + "The code is 9071.",
    "one two three four five six seven eight nine ten " * 14 + "The code is 2718.",
]
QUERIES = [" What is the code?", " code", " Tell me the code, please. The code is"]
N_NEW = 12


def _alone(worker: Worker, pid: str, query: str, method: str, decode: DecodeConfig) -> GenerationStats:
    stats = GenerationStats()
    "".join(worker.generate(pid, query, SamplingParams(max_new_tokens=N_NEW), method=method, decode=decode,
                            stats=stats))
    return stats


def _together(worker: Worker, jobs: list[tuple[str, str, str, DecodeConfig]]) -> list[GenerationStats]:
    """Run generations at once; one thread pulling them in turn makes every step serve all of them."""
    stats = [GenerationStats() for _ in jobs]
    streams: list[GenerationStream] = [
        worker.generate(pid, q, SamplingParams(max_new_tokens=N_NEW), method=m, decode=d, stats=s)
        for (pid, q, m, d), s in zip(jobs, stats, strict=True)]
    drain_together(streams)
    return stats


@pytest.fixture()
def pids(worker: Worker) -> list[str]:
    return [worker.prefill(d).prefix_id for d in DOCS]


# Lookahead needs a trained adapter, hybridkv (and its recall tier) a shipped head ranking: the test model has neither.
@pytest.mark.parametrize("method", sorted(set(METHODS) - NEEDS_ADAPTER - {"hybridkv", "hybridkv+quest"}))
def test_batched_greedy_tokens_equal_one_at_a_time(worker: Worker, pids: list[str], method: str) -> None:
    compressed = method in compression_methods()
    budgets = [DecodeConfig(ratio=f) if compressed else DecodeConfig(budget=f) for f in (0.1, 0.25, 0.5)]
    jobs = [(pid, q, method, d) for pid, q, d in zip(pids, QUERIES, budgets, strict=True)]
    alone = [_alone(worker, *job) for job in jobs]
    together = _together(worker, jobs)
    for a, t in zip(alone, together, strict=True):
        assert a.token_ids and t.token_ids == a.token_ids
        assert t.bytes_fetched == a.bytes_fetched and t.steps == a.steps
    assert max(t.extra["batch_max"] for t in together) == len(jobs)  # they really shared steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", sorted(set(METHODS) - NEEDS_ADAPTER - {"hybridkv", "hybridkv+quest"}))
def test_batched_greedy_tokens_equal_one_at_a_time_on_cuda(store, tiny_model_dir, method: str) -> None:
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    worker = Worker(store, lm, progress=False)
    pids = [worker.prefill(d).prefix_id for d in DOCS]
    compressed = method in compression_methods()
    jobs = [(pid, q, method, DecodeConfig(ratio=f) if compressed else DecodeConfig(budget=f))
            for pid, q, f in zip(pids, QUERIES, (0.1, 0.25, 0.5), strict=True)]
    alone = [_alone(worker, *job).token_ids for job in jobs]
    together = _together(worker, jobs)
    assert [t.token_ids for t in together] == alone


def test_methods_prefixes_and_budgets_mix_in_one_step(endless_worker: Worker) -> None:
    worker = endless_worker  # answers never end early: all four overlap
    pids = [worker.prefill(d).prefix_id for d in DOCS]
    jobs = [(pids[0], QUERIES[0], "full", DecodeConfig()),
            (pids[1], QUERIES[1], "quest", DecodeConfig(budget=0.2)),
            (pids[2], QUERIES[2], "topk+phi", DecodeConfig(budget=0.3)),
            (pids[0], QUERIES[1], "doublep", DecodeConfig())]
    alone = [_alone(worker, *job).token_ids for job in jobs]
    together = _together(worker, jobs)
    assert [t.token_ids for t in together] == alone
    assert max(t.extra["batch_max"] for t in together) == len(jobs)


def test_long_queries_are_fed_in_chunks_with_the_same_tokens(store, lm, pids: list[str]) -> None:
    plain = Worker(store, lm, progress=False)
    chunked = Worker(store, lm, progress=False, engine=EngineConfig(max_batch=2, step_tokens=5))
    jobs = [(pids[i], QUERIES[2], "quest", DecodeConfig(budget=0.25)) for i in range(3)]
    alone = [_alone(plain, *job) for job in jobs]
    together = _together(chunked, jobs)
    for a, t in zip(alone, together, strict=True):
        assert t.token_ids == a.token_ids
        assert t.steps > a.steps  # the query took several steps
    # At most two generations per step: three took turns.
    assert all(t.extra["batch_max"] <= 2 for t in together)


def test_a_failing_method_fails_only_its_generation(worker: Worker, pids: list[str]) -> None:
    ok_stats, bad_stats = GenerationStats(), GenerationStats()
    ok = worker.generate(pids[0], QUERIES[0], SamplingParams(max_new_tokens=N_NEW), method="quest", stats=ok_stats)
    bad = worker.generate(pids[1], QUERIES[1], SamplingParams(max_new_tokens=N_NEW), method="quest", stats=bad_stats)
    gen = bad._gen
    real = gen.prefix
    calls = 0

    class Broken:
        def attend(self, layer, q, scale):  # noqa: ANN001, ANN201
            nonlocal calls
            calls += 1
            if calls > 4:
                raise OSError("page file vanished")
            return real.attend(layer, q, scale)

    gen.prefix = Broken()
    with pytest.raises(OSError, match="vanished"):
        while True:
            next(bad)
            next(ok)
    "".join(ok)
    assert ok_stats.token_ids == _alone(worker, pids[0], QUERIES[0], "quest", DecodeConfig()).token_ids
    assert ok_stats.finish_reason in ("eos", "length", "stop") and bad_stats.new_tokens < N_NEW
    bad.close()
    assert worker.store.leases(pids[1]) == [] and worker.store.leases(pids[0]) == []
    assert worker.engine.running() == 0


def test_cancel_from_another_thread_stops_only_that_generation(endless_worker: Worker) -> None:
    w = endless_worker
    pid = w.prefill(DOCS[0]).prefix_id
    keep = w.generate(pid, QUERIES[0], SamplingParams(max_new_tokens=40))
    stop = w.generate(pid, QUERIES[1], SamplingParams(max_new_tokens=4000))
    next(keep)
    next(stop)
    threading.Thread(target=stop.cancel).start()
    with pytest.raises(Cancelled):
        for _ in range(4000):
            next(stop)
    stop.close()
    assert len("".join(keep)) > 0
    assert w.store.leases(pid) == [] and w.engine.running() == 0


class _Gate:
    """A turn on the model that a test holds shut: steps wait at it until ``open``."""

    def __init__(self) -> None:
        self.opened, self.entered = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered.set()
        assert self.opened.wait(10), "the test never opened the gate"
        yield


def test_a_generation_that_joins_while_a_step_waits_for_its_turn_rides_that_step(endless_worker: Worker) -> None:
    """The step's generations are taken once the model is its own, not before waiting (a tenant's request that
    opened meanwhile would otherwise wait out a whole step of the others first)."""
    w = endless_worker
    pid = w.prefill(DOCS[0]).prefix_id
    gate = _Gate()
    w.engine.turn = gate
    x = w.generate(pid, QUERIES[0], SamplingParams(max_new_tokens=4))
    y = w.generate(pid, QUERIES[1], SamplingParams(max_new_tokens=4))
    tx = threading.Thread(target=next, args=(x,))
    tx.start()
    assert gate.entered.wait(10)  # x's first step waits for the model
    ty = threading.Thread(target=next, args=(y,))
    ty.start()
    for _ in range(1000):
        if w.engine.running() == 2:
            break
        threading.Event().wait(0.01)
    assert w.engine.running() == 2  # y joined while x's step waited
    gate.opened.set()
    tx.join(10)
    ty.join(10)
    assert x._gen.batch_sizes[0] == 2  # that step served y too
    assert "".join(x) + "".join(y) is not None


def test_closing_a_finished_generation_does_not_wait_for_a_step_without_it(endless_worker: Worker) -> None:
    """Under load one step follows another at once: a generation waiting for every running step to end before it
    may leave would wait for several."""
    w = endless_worker
    pid = w.prefill(DOCS[0]).prefix_id
    x = w.generate(pid, QUERIES[0], SamplingParams(max_new_tokens=2))
    y = w.generate(pid, QUERIES[1], SamplingParams(max_new_tokens=400))
    next(y)
    while not x._gen.done:
        next(x)
    gate = _Gate()
    w.engine.turn = gate
    ty = threading.Thread(target=next, args=(y,))
    ty.start()
    assert gate.entered.wait(10)  # a step of y alone is under way (waiting for the model)
    closed = threading.Event()
    tx = threading.Thread(target=lambda: ("".join(x), closed.set()))
    tx.start()
    try:
        assert closed.wait(5), "closing x waited for a step that does not use it"
    finally:
        gate.opened.set()
        tx.join(10)
        ty.join(10)
        y.close()
    assert w.engine.running() == 0


def test_engine_config_is_checked() -> None:
    with pytest.raises(ValueError):
        EngineConfig(max_batch=0)
    with pytest.raises(ValueError):
        EngineConfig(max_batch=8, step_tokens=4)


def test_a_tenant_with_many_generations_gets_no_more_per_step_than_the_others(endless_worker: Worker) -> None:
    w = endless_worker
    pid_a = w.prefill(DOCS[0], tenant="a").prefix_id
    pid_b = w.prefill(DOCS[1], tenant="b").prefix_id
    flood_stats = [GenerationStats() for _ in range(4)]
    flood = [w.generate(pid_a, QUERIES[0], SamplingParams(max_new_tokens=60), tenant="a", stats=st)
             for st in flood_stats]
    for s in flood:
        next(s)  # all four running
    b_stats = GenerationStats()
    "".join(w.generate(pid_b, QUERIES[1], SamplingParams(max_new_tokens=8), tenant="b", stats=b_stats))
    assert b_stats.extra["batch_max"] == 2  # b's steps served one of a's generations besides b's own
    for s in flood:
        s.close()
    alone = GenerationStats()
    streams = [w.generate(pid_a, QUERIES[0], SamplingParams(max_new_tokens=6), tenant="a", stats=st)
               for st in (alone, GenerationStats(), GenerationStats())]
    for s in streams:
        next(s)
    for s in streams:
        "".join(s)
    assert alone.extra["batch_max"] == 3  # one tenant alone is batched whole


def test_a_stream_holds_its_prefix_from_generate_and_lets_go_even_unread(worker: Worker, pids: list[str]) -> None:
    from store.errors import PrefixInUse

    s = worker.generate(pids[0], QUERIES[0], SamplingParams(max_new_tokens=4), method="quest")
    assert len(worker.store.leases(pids[0])) == 1  # leased before its first step
    with pytest.raises(PrefixInUse):
        worker.remove_prefix(pids[0], unless_leased=True)
    assert worker.store.find(pids[0]) is not None  # refused: nothing removed
    s.close()  # never iterated
    assert worker.store.leases(pids[0]) == []
    worker.remove_prefix(pids[0], unless_leased=True)
    assert worker.store.find(pids[0]) is None


def test_an_infeasible_phi_plan_is_refused_with_the_numbers(worker: Worker, pids: list[str]) -> None:
    from store.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"allows \d+ token equivalents per step, fewer than the 4 sink \+ 16 tail"):
        worker.generate(pids[0], QUERIES[0], method="topk+phi", decode=DecodeConfig(budget=0.01))
    assert worker.store.leases(pids[0]) == []  # nothing held after the refusal
    "".join(worker.generate(pids[0], QUERIES[0], SamplingParams(max_new_tokens=2), method="topk",
                            decode=DecodeConfig(budget=0.01)))  # selection only: no φ fetch to pay for


def test_a_generation_joins_the_engine_when_it_is_asked_for_not_when_first_pulled(worker: Worker) -> None:
    """A consumer pulling several streams in turn (or one not pulled yet) still has every generation in each step:
    generations join at ``generate``; one closed without ever being pulled leaves the engine."""
    pids = [worker.prefill(d).prefix_id for d in DOCS]
    stats = [GenerationStats() for _ in pids]
    streams = [worker.generate(pid, q, SamplingParams(max_new_tokens=N_NEW), method="quest",
                               decode=DecodeConfig(budget=0.25), stats=st)
               for pid, q, st in zip(pids, QUERIES, stats, strict=True)]
    assert worker.engine.running() == len(pids)
    "".join(streams[0])  # only the first is pulled: its steps advance the others too
    assert stats[0].extra["batch_max"] == len(pids)
    assert all(st.steps > 0 for st in stats[1:])
    for s in streams[1:]:
        s.close()  # never pulled
    assert worker.engine.running() == 0 and all(worker.store.leases(pid) == [] for pid in pids)


def test_time_to_first_token_counts_the_open(worker: Worker, pids: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``ttft_s`` runs from the call, so a slow open (here: summaries that take 0.3 s to read) is in it, and
    ``open_s`` / ``summaries_s`` say how much of it was opening."""
    slow = 0.3
    start = KVStore.artifact_read  # every artifact read starts here, streamed or whole

    def slow_start(self: KVStore, *a: object, **k: object) -> object:
        time.sleep(slow)
        return start(self, *a, **k)

    worker.summaries.drop(pids[0])
    # A finished generation's shared bounds may linger in a reference cycle until a collection: then nothing
    # is read (and summaries_s is rightly 0); collect so this generation reads them.
    gc.collect()
    key = PrefixSource(worker.store, worker.store.manifest(pids[0]), worker.lm.device).shared_key(
        QuestBounds.name)
    assert not is_held(key)
    monkeypatch.setattr(KVStore, "artifact_read", slow_start)
    st = _alone(worker, pids[0], QUERIES[0], "quest", DecodeConfig(budget=0.5))
    e = st.extra
    assert slow <= e["summaries_s"] <= e["open_s"] <= e["ttft_s"] <= st.seconds, e
