"""The gateway under pressure and failure: 429 + Retry-After, disconnects cancel, broken streams end with an error."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from grpc_health.v1 import health_pb2

from services.gateway import _openai_stream, _sse
from services.grpc_common import ServerConfig, build_server, watch_health
from services.healthcheck import check
from services.scheduler import SchedulerConfig
from tests.gateway_harness import HEADERS, Services, services
from tests.services_harness import free_port
from workers.engine import Worker

DOC = "A short memo about the vault and the courier. " * 4
LONG = {"query": "q", "max_new_tokens": 60_000}
"""Tens of seconds of decoding on the endless model: far longer than any bound below."""
FREED_WITHIN_S = 3.0


@pytest.fixture()
def svc(endless_worker: Worker):
    with services(endless_worker, SchedulerConfig(max_per_tenant=1, max_active=4, retry_after_s=3)) as s:
        yield s


def _prefill(svc: Services, tenant: str = "a") -> str:
    r = httpx.post(f"{svc.url}/v1/prefixes", json={"document": DOC}, headers=HEADERS[tenant], timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["prefix_id"]


def _short(svc: Services, pid: str, tenant: str = "a") -> httpx.Response:
    return httpx.post(f"{svc.url}/v1/prefixes/{pid}/generate", json={"query": "q", "max_new_tokens": 2},
                      headers=HEADERS[tenant], timeout=60)


def _seconds_until_served(svc: Services, pid: str) -> float:
    """Seconds until tenant a (one generation at a time) is served again."""
    t0 = time.monotonic()
    while (r := _short(svc, pid)).status_code == 429:
        assert time.monotonic() - t0 < 60, "tenant a was never served again"
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_a_busy_tenant_gets_429_with_retry_after_and_others_are_served(svc: Services) -> None:
    pid_a, pid_b = _prefill(svc, "a"), _prefill(svc, "b")
    with httpx.stream("POST", f"{svc.url}/v1/prefixes/{pid_a}/generate", json={**LONG, "stream": True},
                      headers=HEADERS["a"], timeout=60) as s:
        lines = s.iter_lines()  # kept: a dropped line iterator closes the response, and the client is gone
        assert next(lines).startswith("data: ")
        r = _short(svc, pid_a)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        oa = httpx.post(f"{svc.url}/v1/completions", json={"prompt": "q", "prefix_id": pid_a, "max_tokens": 2},
                        headers=HEADERS["a"], timeout=60)
        assert oa.status_code == 429 and oa.headers["retry-after"] == "3"
        assert _short(svc, pid_b, "b").status_code == 200
        assert next(ln for ln in lines if ln).startswith("data: ")  # a's generation is still going


@pytest.mark.parametrize("route", ["sse", "openai-stream", "plain", "openai-plain"])
def test_a_client_that_goes_away_frees_the_worker(svc: Services, route: str) -> None:
    pid = _prefill(svc)
    path, body = (f"/v1/prefixes/{pid}/generate", LONG) if not route.startswith("openai") else (
        "/v1/completions", {"prompt": "q", "prefix_id": pid, "max_tokens": LONG["max_new_tokens"]})
    if route in ("sse", "openai-stream"):
        with httpx.stream("POST", f"{svc.url}{path}", json={**body, "stream": True}, headers=HEADERS["a"],
                          timeout=60) as s:
            assert next(s.iter_lines()).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the answer is being generated
            httpx.post(f"{svc.url}{path}", json=body, headers=HEADERS["a"], timeout=1.0)
    assert _seconds_until_served(svc, pid) < FREED_WITHIN_S


def _lines_after_the_worker_dies(svc: Services, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{svc.url}{path}", json={**body, "stream": True}, headers=HEADERS["a"],
                      timeout=60) as s:
        lines = s.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        svc.worker_server.stop(0)
        return [first, *(ln for ln in lines if ln)]


def test_a_worker_gone_mid_stream_ends_the_sse_stream_with_an_error_event(svc: Services) -> None:
    pid = _prefill(svc)
    lines = _lines_after_the_worker_dies(svc, f"/v1/prefixes/{pid}/generate", LONG)
    assert lines[-2] == "event: error" and json.loads(lines[-1][5:])["code"] in ("CANCELLED", "UNAVAILABLE")
    assert "event: done" not in lines


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_worker_gone_mid_stream_ends_the_openai_stream_with_an_error_chunk(svc: Services, path: str) -> None:
    pid = _prefill(svc)
    body = {"prefix_id": pid, "max_tokens": LONG["max_new_tokens"],
            **({"prompt": "q"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "q"}]})}
    lines = _lines_after_the_worker_dies(svc, path, body)
    assert lines[-1] == "data: [DONE]"
    assert set(json.loads(lines[-2][5:])["error"]) >= {"message", "code"}
    assert all(json.loads(ln[5:]).get("choices") for ln in lines[:-2])


def test_streams_that_end_without_their_closing_event_say_so() -> None:
    lines = list(_sse(iter([])))
    assert lines[-1].startswith("event: error\n")
    lines = list(_openai_stream(iter([]), "cmpl-1", 0, "m", chat=False))
    assert json.loads(lines[0][5:])["error"]["code"] == "UNAVAILABLE" and lines[-1] == "data: [DONE]\n\n"


def test_readyz_names_the_dependency_that_is_down(svc: Services) -> None:
    deadline = time.monotonic() + 20  # a health probe can time out on a loaded 2-core machine: ready first
    while (r := httpx.get(f"{svc.url}/readyz")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200 and r.json() == {"status": "ready", "worker": "SERVING", "store": "SERVING"}
    svc.store_health.set("kvstash.v1.KVStore", health_pb2.HealthCheckResponse.NOT_SERVING)
    r = httpx.get(f"{svc.url}/readyz")
    assert r.status_code == 503 and r.json()["store"] == "NOT_SERVING" and r.json()["worker"] == "SERVING"
    svc.worker_server.stop(0)
    r = httpx.get(f"{svc.url}/readyz")
    assert r.status_code == 503 and r.json()["worker"] == "UNAVAILABLE"
    assert httpx.get(f"{svc.url}/healthz").status_code == 200  # liveness is the gateway's own


def test_a_failing_probe_marks_the_server_not_serving_until_it_passes() -> None:
    cfg = ServerConfig(port=free_port())
    server, health = build_server(cfg, ["svc.Test"], lambda s: None)
    server.start()
    failing = threading.Event()

    def probe() -> None:
        if failing.is_set():
            raise ConnectionError("metadata backend unreachable")

    watch_health(health, ["svc.Test"], probe, interval_s=0.05)
    try:
        assert check(cfg.address, "svc.Test")
        failing.set()
        _until(lambda: not check(cfg.address, "svc.Test") and not check(cfg.address))
        failing.clear()
        _until(lambda: check(cfg.address, "svc.Test"))
    finally:
        server.stop(0)


def _until(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_gateway_stubs_reconnect_quickly_to_a_restarted_server(endless_worker: Worker) -> None:
    # A server that was down when the channel first tried: the next try comes within the short backoff.
    from services.gateway import GatewayConfig, create_app
    from tests.gateway_harness import KEYS, serve_http

    port = free_port()
    app = create_app(GatewayConfig(worker_addr=f"127.0.0.1:{port}", store_addr=f"127.0.0.1:{port}"), KEYS)
    with serve_http(app) as url:
        for _ in range(3):  # fail a few times: gRPC's default backoff would now be seconds long
            assert httpx.get(f"{url}/readyz").status_code == 503
            time.sleep(0.3)
        server, _ = build_server(ServerConfig(port=port), ["kvstash.v1.Worker", "kvstash.v1.KVStore"],
                                 lambda s: None)
        server.start()
        t0 = time.monotonic()
        try:
            _until(lambda: httpx.get(f"{url}/readyz").status_code == 200, timeout=10)
            assert time.monotonic() - t0 < 2.0
        finally:
            server.stop(0)
