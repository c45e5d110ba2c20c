"""Whole decode steps over static inputs (``workers.step_graph``): same tokens and counts as the packed step."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import torch

from store.kvstore import KVStore
from store.layout import KVLayout
from workers import decode_batch
from workers.decode_batch import EngineConfig
from workers.engine import DEFAULT_OFFLOAD, Worker, drain_together
from workers.model import LoadedModel, load_model
from workers.own_kv import OwnKV
from workers.requests import DecodeConfig, GenerationStats, SamplingParams
from workers.step_graph import Candidate, StaticMember, StaticStep, StepGraphCache

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


@contextlib.contextmanager
def _groups_made() -> Iterator[list[set[int]]]:
    """Inside the block: for each static step made, the members that pick their pages together in layer 0."""
    grouped: list[set[int]] = []
    real = StaticStep.__init__

    def spy(self: StaticStep, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        grouped.append(self._batch.together.members(0))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticStep, "__init__", spy)
        yield grouped


@pytest.mark.parametrize("method,together", [("quest", True), ("quest+phi", True), ("topk", False)])
def test_members_over_one_prefix_pick_pages_together_with_their_own_tokens(store: KVStore, endless_lm: LoadedModel,
                                                                           method: str, together: bool) -> None:
    """Generations of one prefix length (here one document) score and rank their pages in one launch per layer
    when the method ranks by Quest's bounds (``PagesTogether``); the tokens and reads stay the packed step's.
    Top-K ranks pages on its index: it picks alone."""
    off, static = _worker(store, endless_lm, "off"), _worker(store, endless_lm, "eager")
    pid = off.prefill(DOCS[0]).prefix_id
    want = _run(off, [pid, pid], method, n_new=10)
    with _groups_made() as grouped:
        got = _run(static, [pid, pid], method, n_new=10)
    assert grouped, "no static step was made"
    assert any(g == {0, 1} for g in grouped) == together, grouped
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 10
        assert g.extra["graph_steps"] >= 5
        assert g.bytes_fetched == w.bytes_fetched and g.prefix_tokens_per_step == w.prefix_tokens_per_step


@pytest.mark.parametrize("ahead", [decode_batch.RESERVE_AHEAD, 8])
def test_a_generation_outgrowing_its_own_buffer_gets_a_new_static_step(store: KVStore, endless_lm: LoadedModel,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        ahead: int) -> None:
    monkeypatch.setattr(decode_batch, "RESERVE_AHEAD", ahead)
    off, static = _worker(store, endless_lm, "off"), _worker(store, endless_lm, "eager")
    pids = [off.prefill(d).prefix_id for d in DOCS[:1]]
    n_new = 90  # beyond the buffer's first room (query + 64 tokens)
    want = _run(off, pids, "quest", n_new)
    got = _run(static, pids, "quest", n_new)
    assert got[0].token_ids == want[0].token_ids and len(got[0].token_ids) == n_new
    graphs = static.engine._graphs
    assert graphs is not None
    if ahead >= n_new:  # room for all its steps reserved at its first static step: one capture serves them all
        assert graphs.captures == 1
    else:  # room for 8 steps at a time: the buffer grows mid-generation, and its step is captured again
        assert graphs.captures >= 2


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


def test_a_generation_joining_a_captured_batch_leaves_it_replaying_then_merges(store: KVStore,
                                                                              endless_lm: LoadedModel) -> None:
    off, static = _worker(store, endless_lm, "off"), _worker(store, endless_lm, "eager")
    pids = [off.prefill(d).prefix_id for d in DOCS]
    n_a, n_b = 50, 30
    decode = DecodeConfig(budget=0.3)
    want = []
    for pid, query, n in zip(pids, QUERIES, (n_a, n_b), strict=True):  # each alone
        want.append(GenerationStats())
        drain_together([off.generate(pid, query, SamplingParams(max_new_tokens=n), method="quest", decode=decode,
                                     stats=want[-1])])
    a, b = GenerationStats(), GenerationStats()
    first = static.generate(pids[0], QUERIES[0], SamplingParams(max_new_tokens=n_a), method="quest", decode=decode,
                            stats=a)
    while a.steps < 8:  # A's group is captured and replaying
        next(first)
    second = static.generate(pids[1], QUERIES[1], SamplingParams(max_new_tokens=n_b), method="quest", decode=decode,
                             stats=b)
    drain_together([first, second])
    assert a.token_ids == want[0].token_ids and b.token_ids == want[1].token_ids
    graphs = static.engine._graphs
    assert graphs is not None
    # A alone, B alone once its own steps repeat, both merged MERGE_AFTER steps later; never A again with B.
    # A alone, B alone once its own steps repeat, both merged MERGE_AFTER steps later, A again after B left;
    # never A re-captured because B joined.
    assert graphs.captures == 4 and graphs.merges == 1
    # A: every step from its capture on, also those that fed B's query or ran B eagerly, but its query, its
    # warm-up and the first step of its key (after B left it is captured alone at once: it is known).
    assert a.extra["graph_steps"] == n_a - 3
    assert b.extra["graph_steps"] == n_b - 3


def _candidates(*owners: int) -> list[Candidate]:
    """Stand-ins for generations that could run static (only their keys matter to the planning)."""
    layout = KVLayout(n_layers=1, n_kv_heads=1, head_dim=4, dtype="float32", page_size=4)
    own = OwnKV(layout, 4, torch.device("cpu"), torch.float32)
    prefix: Any = None
    return [Candidate((o, (0, 4), "prefix"), StaticMember(own=own, prefix=prefix)) for o in owners]


def test_a_failed_capture_leaves_its_generations_eager_and_enough_of_them_stop_capturing() -> None:
    class Broken(torch.nn.Module):
        def forward(self, **_: object) -> None:
            raise RuntimeError("cannot be captured")

    # On a CPU the capture itself fails (no CUDA graphs), like a group whose capture breaks on a GPU.
    cache = StepGraphCache(Broken(), torch.device("cpu"), capture=True)
    for i, owners in enumerate([(1,), (2,), (3,)]):
        step = _candidates(*owners)
        assert cache.plan(step) == ([], [0])  # new generations: not captured yet
        assert cache.plan(step) == ([], [0]) and cache.failures == i + 1  # its capture failed: eager
        assert cache.plan(step) == ([], [0]) and cache.failures == i + 1  # not retried
        assert cache.failed == (i == 2)
    cache.plan(_candidates(4))
    assert cache.plan(_candidates(4)) == ([], [0]) and cache.failures == 3  # no capture tried once failed


class _Counting(torch.nn.Module):
    """Records the forward a static step runs (eagerly: ``capture=False``) without computing anything."""

    def forward(self, *, input_ids: torch.Tensor, **_: object) -> object:
        return type("Out", (), {"logits": torch.zeros(1, input_ids.shape[1], 3)})()


def test_a_joining_generation_gets_a_group_of_its_own_and_the_running_group_keeps_replaying() -> None:
    cache = StepGraphCache(_Counting(), torch.device("cpu"), capture=False)
    a = _candidates(1, 2, 3)
    assert cache.plan(a) == ([], [0, 1, 2])  # new: eager
    groups, rest = cache.plan(a)  # repeated: captured
    assert [ids for _, ids in groups] == [[0, 1, 2]] and rest == [] and cache.captures == 1
    joined = _candidates(1, 2, 3, 9)
    groups, rest = cache.plan(joined)  # the newcomer runs eagerly beside the replayed group
    assert [ids for _, ids in groups] == [[0, 1, 2]] and rest == [3]
    groups, rest = cache.plan(joined)  # and is captured alone once it repeats; nobody else is re-captured
    assert sorted(ids for _, ids in groups) == [[0, 1, 2], [3]] and rest == [] and cache.captures == 2
    left = _candidates(1, 3, 9)  # generation 2 left: its group cannot serve; 9 replays, 1 and 3 (seen before)
    groups, rest = cache.plan(left)  # are captured together at once
    assert sorted(ids for _, ids in groups) == [[0, 1], [2]] and rest == [] and cache.captures == 3


def test_generations_taking_turns_each_replay_their_own_group() -> None:
    # One tenant's share of the batch rotates over its four generations (``EngineConfig.tenant_share``); the
    # other tenant's one generation is in every step.
    cache = StepGraphCache(_Counting(), torch.device("cpu"), capture=False)
    steps = [_candidates(100, a) for a in (1, 2, 3, 4)] * 4
    for n, step in enumerate(steps):
        groups, rest = cache.plan(step)
        if n >= 4:  # from the second round on, every step replays captured groups only
            assert rest == [] and sorted(ids for _, ids in groups) == [[0], [1]], n
    assert cache.captures == 5 and cache.replays == 2 * len(steps) - 5 - 5  # 5 captures, 5 first (eager) runs


def test_generations_split_over_groups_are_merged_once_stable() -> None:
    cache = StepGraphCache(_Counting(), torch.device("cpu"), capture=False)
    first, both = _candidates(1), _candidates(1, 2)
    cache.plan(first)
    cache.plan(first)  # group {1}
    cache.plan(both)
    groups, _ = cache.plan(both)  # group {2}
    assert len(groups) == 2 and cache.merges == 0
    for _ in range(StepGraphCache.MERGE_AFTER - 2):
        groups, _ = cache.plan(both)
        assert len(groups) == 2
    groups, rest = cache.plan(both)  # the same two for MERGE_AFTER steps: one group now
    assert [ids for _, ids in groups] == [[0, 1]] and rest == [] and cache.merges == 1 and len(cache) == 1


def test_no_merge_for_generations_about_to_end() -> None:
    """A merged group lasts no longer than its members: none is captured for one whose generation ends within
    MERGE_AFTER steps; the split groups keep replaying."""
    cache = StepGraphCache(_Counting(), torch.device("cpu"), capture=False)
    first, both = _candidates(1), _candidates(1, 2)
    ending = [both[0], Candidate(both[1].key, both[1].member, steps_left=StepGraphCache.MERGE_AFTER - 1)]
    cache.plan(first)
    cache.plan(first)  # group {1}
    cache.plan(both)
    cache.plan(both)  # group {2}
    for _ in range(2 * StepGraphCache.MERGE_AFTER):
        groups, rest = cache.plan(ending)
        assert len(groups) == 2 and rest == []
    assert cache.merges == 0
    groups, _ = cache.plan(both)  # the same two, now expected to last: merged
    assert [ids for _, ids in groups] == [[0, 1]] and cache.merges == 1


def test_a_generation_whose_key_changed_leaves_its_group() -> None:
    cache = StepGraphCache(_Counting(), torch.device("cpu"), capture=False)
    step = _candidates(1, 2)
    cache.plan(step)
    cache.plan(step)
    assert len(cache) == 1
    moved = [step[0], Candidate((2, step[1].key[1], "grown"), step[1].member)]  # e.g. its buffer grew
    groups, rest = cache.plan(moved)  # their group is gone; 1 (known) is captured alone, 2 (new key) runs eagerly
    assert [ids for _, ids in groups] == [[0]] and rest == [1] and len(cache) == 1 and cache.captures == 2


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
@pytest.mark.parametrize("method", ["quest", "quest+phi"])
@pytest.mark.parametrize("offload", ["default", "none"])
def test_cuda_members_picking_pages_together_give_the_eager_steps_tokens_and_reads(store: KVStore, tiny_model_dir,
                                                                                   method: str, offload: str) -> None:
    """Two generations over one prefix: in the captured step they score and rank pages in one launch per layer
    (``PagesTogether``, the Triton kernels), and give the eager steps' tokens and reads."""
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    tiers = None if offload == "none" else DEFAULT_OFFLOAD
    off = Worker(store, lm, progress=False, offload=tiers, engine=EngineConfig(whole_step="off"))
    graphed = Worker(store, lm, progress=False, offload=tiers, engine=EngineConfig(whole_step="auto"))
    pid = off.prefill(DOCS[1]).prefix_id
    want = _run(off, [pid, pid], method, n_new=12)
    with _groups_made() as grouped:
        got = _run(graphed, [pid, pid], method, n_new=12)
    graphs = graphed.engine._graphs
    assert graphs is not None and not graphs.failed and graphs.replays >= 1
    assert {0, 1} in grouped, grouped
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
