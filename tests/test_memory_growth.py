"""A worker serving many generations holds no more afterwards than after the first few: no tensor, lease, engine
entry or host-memory growth per generation (the issue's "no GPU or host memory growth over 1000 generations")."""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import pytest
import torch

from workers.engine import Worker
from workers.model import load_model
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


def _check_no_growth(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    _serve(worker, pid, 50)  # warm: caches of summaries and CRC tables, the host tier, first-use allocations
    tensors = _live_tensors()
    cuda = worker.lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        device_before = torch.cuda.memory_allocated(worker.lm.device)
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
    if cuda:  # the allocator's live bytes, not its reserve: a leaked tensor of any size shows here
        torch.cuda.synchronize()
        device_grown = torch.cuda.memory_allocated(worker.lm.device) - device_before
        assert device_grown <= 1 << 20, f"device memory grew by {device_grown} bytes over 1000 generations"


@pytest.mark.slow
def test_a_thousand_generations_leave_nothing_behind(worker: Worker) -> None:
    _check_no_growth(worker)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_thousand_generations_leave_nothing_behind_on_cuda(store, tiny_model_dir) -> None:  # noqa: ANN001
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    _check_no_growth(Worker(store, lm, chunk_size=40, progress=False))
