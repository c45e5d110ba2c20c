"""Hostile generation requests are refused at both front doors: gateway 4xx, worker INVALID_ARGUMENT."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from fastapi.testclient import TestClient

from services.auth import ApiKeys
from services.gateway import GatewayConfig, create_app
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig
from services.worker_server import WorkerLimits, build_worker_server
from tests.services_harness import free_port
from workers.engine import Worker
from workers.requests import LIMITS

HOSTILE_BODIES = [
    {"temperature": -1}, {"temperature": LIMITS.temperature_max + 1}, {"top_p": 0}, {"top_p": 1.5},
    {"budget": 0}, {"budget": 2}, {"seed": -1}, {"seed": 2**63}, {"gen_len": 0}, {"gen_len": 2**31},
    {"budget_tokens": 0}, {"budget_tokens": LIMITS.budget_tokens_max + 1},
    {"max_new_tokens": 0}, {"max_new_tokens": LIMITS.max_new_tokens_cap + 1}, {"max_new_tokens": 2**63},
    {"stop": [""]}, {"stop": ["s"] * (LIMITS.stop_max_count + 1)}, {"stop": ["s" * (LIMITS.stop_max_chars + 1)]},
    {"method": ""}, {"method": "m" * (LIMITS.method_max_chars + 1)}, {"query": "q" * (LIMITS.query_max_chars + 1)},
    {"query_pages": "some"}, {"query_pages": "s" * 100_000}, {"query_pages": 1},
]


@pytest.fixture(scope="module")
def gateway() -> TestClient:
    # Nothing listens on the worker address: a request that passes validation fails later as UNAVAILABLE.
    dead = f"127.0.0.1:{free_port()}"
    return TestClient(create_app(GatewayConfig(worker_addr=dead, store_addr=dead), ApiKeys()))


@pytest.mark.parametrize("field", HOSTILE_BODIES, ids=lambda d: f"{next(iter(d))}={str(next(iter(d.values())))[:12]}")
def test_gateway_refuses_hostile_fields(gateway: TestClient, field: dict) -> None:
    r = gateway.post(f"/v1/prefixes/{'a' * 32}/generate", json={"query": "q", **field})
    assert r.status_code == 422, r.text[:300]
    assert len(r.text) < 1000  # the offending input is not echoed back
    if "query" not in field:  # the same bounds guard the OpenAI endpoint
        name = {"max_new_tokens": "max_tokens"}.get(next(iter(field)), next(iter(field)))
        r = gateway.post("/v1/completions", json={"prompt": "q", "prefix_id": "a" * 32,
                                                  name: next(iter(field.values()))})
        assert r.status_code == 422, r.text[:300]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "budget"])
def test_gateway_refuses_non_finite_numbers(gateway: TestClient, name: str, value: str) -> None:
    body = f'{{"query": "q", "{name}": {value}}}'
    r = gateway.post(f"/v1/prefixes/{'a' * 32}/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]


def test_gateway_checks_what_pydantic_does_not_see(gateway: TestClient) -> None:
    r = gateway.post(f"/v1/prefixes/{'p' * 10_000}/generate", json={"query": "q"})
    assert r.status_code == 400 and "prefix_id" in r.json()["error"]["message"]
    assert len(r.text) < 500  # the huge id is not echoed back
    r = gateway.post("/v1/completions", json={"prompt": json.dumps({"prefix_id": "p" * 10_000, "query": "q"})})
    assert r.status_code == 400 and len(r.text) < 500
    for body in ({"document": "d", "file_path": "/x"}, {"file_path": "/proc/self/environ"}):
        r = gateway.post("/v1/prefixes", json=body)
        assert r.status_code == 400 and "file_path is not accepted" in r.json()["error"]["message"]
    # In bounds: forwarded (and refused only because no worker listens).
    r = gateway.post(f"/v1/prefixes/{'a' * 32}/generate", json={"query": "q", "temperature": 5e-324, "seed": 2**63 - 1,
                                                                 "budget": 1, "max_new_tokens": 3})
    assert r.status_code == 503, r.text[:300]


@pytest.fixture()
def worker_stub(worker: Worker):
    cfg = ServerConfig(port=free_port())
    server, _ = build_worker_server(worker, cfg, ApiKeys(), WorkerLimits(max_new_tokens_cap=32))
    server.start()
    yield pb_grpc.WorkerStub(grpc.insecure_channel(cfg.address))
    server.stop(0)


def test_worker_refuses_hostile_requests(worker_stub, worker: Worker) -> None:
    pid = worker.prefill("A short memo about the vault. " * 4).prefix_id
    base = {"prefix_id": pid, "query": "q"}
    hostile = [
        {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0}, {"top_p": math.nan},
        {"top_p": 2.0}, {"budget": math.nan}, {"budget": -math.inf}, {"budget": 0.0}, {"seed": -1},
        {"ratio": math.nan}, {"ratio": 0.0}, {"ratio": 1.5},
        {"gen_len": -1}, {"max_new_tokens": -1}, {"max_new_tokens": 33},  # over this worker's cap of 32
        {"stop": [""]}, {"stop": ["s"] * (LIMITS.stop_max_count + 1)}, {"method": "m" * 1000},
        {"query": "q" * (LIMITS.query_max_chars + 1)}, {"prefix_id": "p" * 100_000},
        {"query_pages": "some"}, {"query_pages": "s" * 100_000},
    ]
    for field in hostile:
        with pytest.raises(grpc.RpcError) as e:
            list(worker_stub.Generate(pb.GenerateRequest(**{**base, **field}), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
        assert len(e.value.details()) < 200
    events = list(worker_stub.Generate(pb.GenerateRequest(**base, max_new_tokens=32, seed=2**63 - 1,
                                                          temperature=1.0), timeout=60))
    assert events[-1].HasField("done") and 1 <= events[-1].done.steps <= 32
