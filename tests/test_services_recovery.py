"""Process-level recovery: kill -9 of the worker mid-stream, restart, SIGTERM drains, Redis down -> not ready."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import RedisServer, running_redis
from tests.services_harness import Topology, topology

pytestmark = pytest.mark.slow
KEYS = {"alice": "key-alice"}
ENV = {"KVSTASH_API_KEYS": "key-alice:alice", "KVSTASH_TENANT_SECRET": "s3cret"}
H = {"Authorization": "Bearer key-alice"}
DOC = "Memo. The vault code is 7341. The courier is named Odile and leaves from Lyon at dawn. " * 4
SERVED_AGAIN_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory):
    with running_redis(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, endless_model_dir: Path, redis: RedisServer):
    home = tmp_path_factory.mktemp("recovery") / "home"
    with topology(home, endless_model_dir, ENV, metadata_url=redis.url) as t:
        yield t


def _prefill(topo: Topology) -> str:
    r = httpx.post(f"{topo.gateway_url}/v1/prefixes", json={"document": DOC}, headers=H, timeout=120)
    assert r.status_code == 201, r.text
    return r.json()["prefix_id"]


def _stream_lines_past_a_kill(topo: Topology, path: str, body: dict) -> list[str]:
    """Open a long stream, kill -9 the worker after its first event, and read what the client gets."""
    with httpx.stream("POST", f"{topo.gateway_url}{path}", json={**body, "stream": True}, headers=H,
                      timeout=60) as s:
        lines = s.iter_lines()
        first = next(lines)
        assert first.startswith("data: ") and "error" not in first
        topo.procs["worker"].kill()
        topo.procs["worker"].wait(10)
        return [first, *(ln for ln in lines if ln)]


def _ready_to_served_seconds(topo: Topology, pid: str) -> float:
    """Restart the worker; seconds from its health check passing to the gateway's first answer."""
    topo.restart("worker")  # returns as soon as its gRPC health says SERVING
    t_ready = time.monotonic()
    while True:
        r = httpx.post(f"{topo.gateway_url}/v1/prefixes/{pid}/generate", headers=H, timeout=60,
                       json={"query": "q", "max_new_tokens": 2})
        if r.status_code == 200:
            return time.monotonic() - t_ready
        assert r.status_code == 503 and time.monotonic() - t_ready < 30, r.text
        time.sleep(0.05)


def test_kill_9_mid_stream_gives_an_error_event_and_a_restart_serves_within_2_s(topo: Topology) -> None:
    pid = _prefill(topo)
    lines = _stream_lines_past_a_kill(topo, f"/v1/prefixes/{pid}/generate", {"query": "q", "max_new_tokens": 60_000})
    assert lines[-2] == "event: error" and json.loads(lines[-1][5:])["code"] == "UNAVAILABLE", lines[-3:]
    ready = httpx.get(f"{topo.gateway_url}/readyz")
    assert ready.status_code == 503 and ready.json()["worker"] != "SERVING" and ready.json()["store"] == "SERVING"
    assert _ready_to_served_seconds(topo, pid) < SERVED_AGAIN_WITHIN_S
    assert httpx.get(f"{topo.gateway_url}/readyz").status_code == 200

    from openai import APIError, OpenAI

    oa = OpenAI(base_url=f"{topo.gateway_url}/v1", api_key=KEYS["alice"], max_retries=0)
    stream = oa.chat.completions.create(model="kvstash", messages=[{"role": "user", "content": "q"}],
                                        max_tokens=60_000, stream=True, extra_body={"prefix_id": pid})
    with pytest.raises(APIError):  # the error chunk, not a silent end of the stream
        for i, _ in enumerate(stream):
            if i == 0:
                topo.procs["worker"].kill()
    topo.procs["worker"].wait(10)
    assert _ready_to_served_seconds(topo, pid) < SERVED_AGAIN_WITHIN_S


def test_sigterm_drains_in_flight_streams_and_exits_0(topo: Topology) -> None:
    pid = _prefill(topo)
    with httpx.stream("POST", f"{topo.gateway_url}/v1/prefixes/{pid}/generate", headers=H, timeout=60,
                      json={"query": "q", "max_new_tokens": 120, "stream": True}) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
        topo.procs["worker"].send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln]
    assert "event: done" in rest and "event: error" not in rest  # the stream in flight finished
    assert topo.procs["worker"].wait(30) == 0, topo.log("worker")[-4000:]
    assert "draining" in topo.log("worker")
    topo.restart("worker")
    topo.procs["store"].send_signal(signal.SIGTERM)
    assert topo.procs["store"].wait(30) == 0
    assert httpx.get(f"{topo.gateway_url}/readyz").json()["store"] != "SERVING"
    topo.restart("store")
    assert _seconds_until_ready(topo) < SERVED_AGAIN_WITHIN_S


def _seconds_until_ready(topo: Topology, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while httpx.get(f"{topo.gateway_url}/readyz").status_code != 200:
        assert time.monotonic() - t0 < timeout, "the gateway is not ready"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_redis_down_makes_the_gateway_not_ready_until_it_is_back(topo: Topology, redis: RedisServer) -> None:
    _seconds_until_ready(topo)
    redis.stop()
    try:
        deadline = time.monotonic() + 30
        # The store and the worker each probe Redis once a second: wait for the store's to fail.
        while (r := httpx.get(f"{topo.gateway_url}/readyz")).json()["store"] == "SERVING":
            assert time.monotonic() < deadline, "the store still serving with Redis down"
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["store"] == "NOT_SERVING", r.json()
        assert httpx.get(f"{topo.gateway_url}/healthz").status_code == 200  # alive, only not ready
    finally:
        redis.start()
    _seconds_until_ready(topo)
