"""The worker server under two tenants: bounded admission with retry-after, interleaving, cancellation."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from services.auth import ApiKeys
from services.convert import RETRY_AFTER_TRAILER
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig
from services.scheduler import SchedulerConfig
from services.worker_server import build_worker_server
from store.errors import Cancelled
from tests.services_harness import free_port
from workers.engine import Worker
from workers.requests import GenerationStats, SamplingParams

KEYS = ApiKeys({"key-a": "a", "key-b": "b"})
MD_A, MD_B = [("x-api-key", "key-a")], [("x-api-key", "key-b")]
DOC = "A short memo about the vault and the courier. " * 4


@pytest.fixture()
def stub(endless_worker: Worker):
    cfg = ServerConfig(port=free_port())
    scheduling = SchedulerConfig(max_per_tenant=1, max_active=2, retry_after_s=3)
    server, _ = build_worker_server(endless_worker, cfg, KEYS, scheduling=scheduling)
    server.start()
    yield pb_grpc.WorkerStub(grpc.insecure_channel(cfg.address))
    server.stop(0).wait(30)
    gc.collect()  # streams the stop abandoned let go of their leases now, while the store is still open


def _prefill(stub: pb_grpc.WorkerStub, md: list[tuple[str, str]]) -> str:
    return stub.Prefill(iter([pb.PrefillChunk(text=DOC)]), metadata=md, timeout=60).prefix_id


def _long(stub: pb_grpc.WorkerStub, pid: str):  # noqa: ANN202
    """A generation that would run for thousands of steps, started and past its first piece."""
    call = stub.Generate(pb.GenerateRequest(prefix_id=pid, query="q", max_new_tokens=60_000), metadata=MD_A,
                         timeout=120)
    next(call)
    return call


def test_a_tenant_over_its_bound_is_told_when_to_retry_and_others_are_served(stub) -> None:
    pid_a, pid_b = _prefill(stub, MD_A), _prefill(stub, MD_B)
    call = _long(stub, pid_a)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prefix_id=pid_a, query="q", max_new_tokens=2), metadata=MD_A))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.value.trailing_metadata())[RETRY_AFTER_TRAILER] == "3"
    # Tenant b is served while a's long generation goes on: turns interleave.
    t0 = time.perf_counter()
    events = list(stub.Generate(pb.GenerateRequest(prefix_id=pid_b, query="q", max_new_tokens=4), metadata=MD_B,
                                timeout=60))
    assert events[-1].HasField("done") and time.perf_counter() - t0 < 20
    assert next(call).text is not None  # ... and a's is still running
    call.cancel()


def test_cancelling_a_call_frees_its_place_at_the_next_step(stub) -> None:
    pid = _prefill(stub, MD_A)
    call = _long(stub, pid)
    t0 = time.perf_counter()
    call.cancel()
    deadline = t0 + 10
    while True:  # tenant a's one place comes back once the cancelled generation has stopped
        try:
            events = list(stub.Generate(pb.GenerateRequest(prefix_id=pid, query="q", max_new_tokens=2),
                                        metadata=MD_A, timeout=60))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)
    assert events[-1].HasField("done") and time.perf_counter() - t0 < 10


def test_a_prefill_counts_against_the_bound(stub) -> None:
    pid = _prefill(stub, MD_A)
    call = _long(stub, pid)
    with pytest.raises(grpc.RpcError) as e:
        _prefill(stub, MD_A)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    done = threading.Event()
    threading.Thread(target=lambda: (_prefill(stub, MD_B), done.set())).start()
    assert done.wait(30)  # another tenant's prefill takes its turn between a's steps
    call.cancel()


def test_a_step_turn_that_raises_stops_the_generation_and_releases_its_lease(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    turns = 0

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        nonlocal turns
        turns += 1
        if turns > 3:
            raise Cancelled("the caller went away")
        yield

    stats = GenerationStats()
    worker.engine.turn = turn
    try:
        with pytest.raises(Cancelled):
            "".join(worker.generate(pid, "q", SamplingParams(max_new_tokens=50), stats=stats))
    finally:
        worker.engine.turn = contextlib.nullcontext
    assert turns == 4 and stats.steps == 3 and worker.store.leases(pid) == []


def test_deleting_a_prefix_a_generation_reads_is_refused_until_it_ends(stub) -> None:
    pid = _prefill(stub, MD_A)
    call = _long(stub, pid)
    with pytest.raises(grpc.RpcError) as e:
        stub.DeletePrefix(pb.PrefixRef(prefix_id=pid), metadata=MD_A, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use" in e.value.details()
    call.cancel()
    deadline = time.monotonic() + 30
    while True:  # the lease goes when the cancelled generation stops at its next step
        try:
            stub.DeletePrefix(pb.PrefixRef(prefix_id=pid), metadata=MD_A, timeout=30)
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as gone:
        stub.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=MD_A, timeout=30)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
