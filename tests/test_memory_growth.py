"""A worker serving many generations holds no more afterwards than after the first few: no tensor, lease, engine
entry or host-memory growth per generation (the issue's "no GPU or host memory growth over 1000 generations")."""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import pytest
import torch

from workers.engine import Worker
from workers.requests import DecodeConfig, SamplingParams

DOC = "The lighthouse keeper counts the ships that pass the cape each night and writes them down. " * 12
QUERIES = [" How many ships?", " What does the keeper write?", " Where is the lighthouse?"]
METHODS = [("full", DecodeConfig()), ("quest", DecodeConfig(budget=0.25)), ("topk", DecodeConfig(budget=0.25)),
           ("doublep", DecodeConfig(budget=0.25)), ("snapkv", DecodeConfig(budget_tokens=32))]


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # looking at every object touches torch's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _serve(worker: Worker, pid: str, n: int) -> None:
    for i in range(n):
        method, decode = METHODS[i % len(METHODS)]
        "".join(worker.generate(pid, QUERIES[i % len(QUERIES)], SamplingParams(max_new_tokens=3), method=method,
                                decode=decode))


@pytest.mark.slow
def test_a_thousand_generations_leave_nothing_behind(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    _serve(worker, pid, 50)  # warm: caches of summaries and CRC tables, the host tier, first-use allocations
    tensors = _live_tensors()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        _serve(worker, pid, 1000)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert worker.engine.running() == 0 and worker.store.leases(pid) == []
    assert _live_tensors() <= tensors + 8, "tensors accumulate per generation"
    # A leak of even 1 KiB per generation would be 1 MB here; what remains is interpreter noise (caches of code
    # objects, interned strings).
    assert grown < 256 << 10, f"host memory grew by {grown} bytes over 1000 generations"
