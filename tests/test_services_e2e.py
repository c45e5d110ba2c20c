"""Process-level e2e: store + worker + gateway on loopback, used through gRPC, REST/SSE and OpenAI."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis as redis_client

from client import KVClient
from client.backends import RemoteError
from services.auth import ServiceToken
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from store.config import StoreConfig
from store.kvstore import KVStore
from tests.redis_server import RedisServer, running_redis
from tests.services_harness import SERVICE_TOKEN, start, stop, topology, wait_grpc

pytestmark = pytest.mark.slow  # real processes: redis, store, worker and gateway

KEYS = {"alice": "key-alice", "bob": "key-bob"}
ENV = {"KVSTASH_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items()), "KVSTASH_TENANT_SECRET": "s3cret",
       "KVSTASH_SERVICE_TOKEN": SERVICE_TOKEN}
ALICE_AT_STORE = ServiceToken(SERVICE_TOKEN).metadata("alice")
DOC = "Memo. The vault code is 7341. The courier is named Odile and leaves from Lyon at dawn. " * 6
QUERIES = [" The vault code is", " The courier is named", " She leaves from"]
MAX_DOC_BYTES = 50_000
N_NEW = 12


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory):
    with running_redis(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis: RedisServer):
    home = tmp_path_factory.mktemp("e2e") / "home"
    with topology(home, tiny_model_dir, ENV, metadata_url=redis.url,
                  # Room for the 16 concurrent generations of one tenant below (the bound is tested elsewhere).
                  worker_args=("--max-document-bytes", str(MAX_DOC_BYTES), "--max-per-tenant", "16",
                               "--max-active", "32"),
                  gateway_args=("--max-body-bytes", str(4 * MAX_DOC_BYTES))) as t:
        t.home = home  # type: ignore[attr-defined]
        yield t


def _h(tenant: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _embedded_answers(tmp_path: Path, model: Path) -> list[str]:
    kv = KVClient(home=tmp_path / "embedded", model=str(model), device="cpu", progress=False)
    doc = kv.prefill(DOC)
    return [kv.generate(q, prefix=doc, max_new_tokens=N_NEW).text for q in QUERIES]


def test_three_frontends_match_embedded(topo, tmp_path: Path, tiny_model_dir: Path) -> None:
    r = httpx.post(f"{topo.gateway_url}/v1/prefixes", json={"document": DOC}, headers=_h(), timeout=120)
    assert r.status_code == 201, r.text
    pid = r.json()["prefix_id"]
    expected = _embedded_answers(tmp_path, tiny_model_dir)

    # gRPC clients need only the worker: an old URL's store= (here a dead address) is ignored.
    via_grpc = KVClient(f"grpc://{topo.worker_addr}?store=127.0.0.1:9", api_key=KEYS["alice"])
    assert via_grpc.generate(QUERIES[0], prefix=pid, max_new_tokens=N_NEW).text == expected[0]

    via_sse = KVClient(topo.gateway_url, api_key=KEYS["alice"])
    gen = via_sse.generate(QUERIES[1], prefix=pid, max_new_tokens=N_NEW)
    assert "".join(gen) == expected[1]
    assert gen.stats.steps >= 1 and gen.stats.bytes_full > 0

    from openai import OpenAI

    oa = OpenAI(base_url=f"{topo.gateway_url}/v1", api_key=KEYS["alice"])
    c = oa.completions.create(model="kvstash", prompt=QUERIES[2], max_tokens=N_NEW, temperature=0,
                              extra_body={"prefix_id": pid})
    assert c.choices[0].text == expected[2]
    c2 = oa.completions.create(model="kvstash", prompt=json.dumps({"prefix_id": pid, "query": QUERIES[2]}),
                               max_tokens=N_NEW, temperature=0)
    assert c2.choices[0].text == expected[2]
    stream = oa.chat.completions.create(model="kvstash", messages=[{"role": "user", "content": QUERIES[2]}],
                                        max_tokens=N_NEW, temperature=0, stream=True, extra_body={"prefix_id": pid})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == expected[2]
    chat = oa.chat.completions.create(model="kvstash", messages=[{"role": "user", "content": QUERIES[2]}],
                                      max_tokens=N_NEW, temperature=0, extra_body={"prefix_id": pid})
    assert chat.choices[0].message.content == expected[2] and chat.usage.completion_tokens >= 1

    # Same prefix listed through both front doors, and the raw SSE wire format is as documented.
    assert pid in [m.prefix_id for m in via_grpc.ls()] and via_sse.info(pid).n_tokens == r.json()["n_tokens"]
    with httpx.stream("POST", f"{topo.gateway_url}/v1/prefixes/{pid}/generate", headers=_h(),
                      json={"query": QUERIES[0], "max_new_tokens": 3, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[0].startswith("data: ") and "event: done" in lines
    schema = httpx.get(f"{topo.gateway_url}/openapi.json").json()
    assert {"/v1/prefixes", "/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    # A sparse method decodes over pages fetched per step; the gateway's metrics count them by tier.
    sparse = httpx.post(f"{topo.gateway_url}/v1/prefixes/{pid}/generate", headers=_h(), timeout=60,
                        json={"query": QUERIES[0], "max_new_tokens": 3, "method": "quest", "budget": 0.2}).json()
    assert sparse["stats"]["offload_pages_requested"] > 0
    # The query's tokens sharing one page selection rides both wires (the worker decodes with what it is sent:
    # tests/test_query_pages.py), and gives the same tokens either way in.
    shared = httpx.post(f"{topo.gateway_url}/v1/prefixes/{pid}/generate", headers=_h(), timeout=60,
                        json={"query": QUERIES[0], "max_new_tokens": 3, "method": "quest", "budget": 0.2,
                              "query_pages": "shared"})
    assert shared.status_code == 200, shared.text
    assert via_grpc.generate(QUERIES[0], prefix=pid, max_new_tokens=3, method="quest", budget=0.2,
                             query_pages="shared").text == shared.json()["text"]
    # Device memory per generation, by part. The page cache part is 0 once a CPU worker attends the warm prefix
    # in the host tier (``HostPageView``), and the fetcher's pool before that: either way no more than the whole.
    stats = sparse["stats"]
    assert stats["device_bytes"] > 0 and stats["device_bytes_own_kv"] > 0
    assert stats["device_bytes"] >= stats["device_bytes_page_cache"] >= 0
    metrics = httpx.get(f"{topo.gateway_url}/metrics").text

    def metric(name: str) -> float:
        return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name))

    assert metric("kvstash_generated_tokens_total") > 0
    assert metric('kvstash_offload_pages_total{tier="ssd"}') + metric('kvstash_offload_pages_total{tier="host"}') > 0
    fetched, full = (metric(f'kvstash_prefix_kv_bytes_total{{kind="{k}"}}') for k in ("fetched", "full"))
    assert 0 < fetched < full


def test_bad_input_is_a_clear_error(topo) -> None:
    url = topo.gateway_url
    pid = httpx.post(f"{url}/v1/prefixes", json={"document": DOC}, headers=_h(), timeout=120).json()["prefix_id"]
    r = httpx.post(f"{url}/v1/prefixes/{'0' * 32}/generate", json={"query": "x"}, headers=_h())
    assert r.status_code == 404 and "no prefix" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/prefixes/{pid}/generate", json={"query": "x"}, headers=_h("bob"))
    assert r.status_code == 404  # another tenant's prefix: not found, not forbidden
    assert httpx.get(f"{url}/v1/prefixes/{pid}", headers=_h("bob")).status_code == 404
    assert httpx.get(f"{url}/v1/prefixes", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{url}/v1/prefixes").status_code == 401
    r = httpx.post(f"{url}/v1/prefixes", json={"document": "y" * (MAX_DOC_BYTES + 10)}, headers=_h(), timeout=60)
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/prefixes", json={"document": "y" * (5 * MAX_DOC_BYTES)}, headers=_h(), timeout=60)
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/prefixes", content=b"{not json", headers={**_h(), "content-type": "application/json"})
    assert r.status_code == 400 and "malformed" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/prefixes", json={"document": ""}, headers=_h())
    assert r.status_code == 400
    # Nothing of the above created or removed a prefix.
    assert [p["prefix_id"] for p in httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"]] == [pid]
    assert httpx.get(f"{url}/v1/prefixes", headers=_h("bob")).json()["prefixes"] == []

    ch = grpc.insecure_channel(topo.worker_addr)
    stub = pb_grpc.WorkerStub(ch)
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(iter([pb.PrefillChunk(text="z" * (MAX_DOC_BYTES + 1))]), metadata=[("x-api-key", KEYS["alice"])])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        stub.Info(pb.InfoRequest(), metadata=[("x-api-key", "bad")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prefix_id="f" * 32, query="q"), metadata=[("x-api-key", KEYS["bob"])]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        grpc.insecure_channel(topo.store_addr).unary_unary("/kvstash.v1.KVStore/GetManifest")(
            b"\xff\xff\xff", metadata=ALICE_AT_STORE)
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    # A cancelled stream stops, and the worker serves the next request.
    call = stub.Generate(pb.GenerateRequest(prefix_id=pid, query="x", max_new_tokens=200),
                         metadata=[("x-api-key", KEYS["alice"])])
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    client = KVClient(f"grpc://{topo.worker_addr}", api_key=KEYS["alice"])
    assert client.generate("x", prefix=pid, max_new_tokens=2).stats.new_tokens >= 0
    with pytest.raises(RemoteError) as re:
        _ = client.generate("x", prefix="e" * 32).text
    assert re.value.grpc_code == "NOT_FOUND" and re.value.http_status == 404


def test_concurrent_prefill_is_single_flight_and_generations_complete(topo) -> None:
    url = topo.gateway_url
    doc = DOC + " Concurrency edition."
    results: list[dict] = []

    def prefill() -> None:
        # Over the worker's per-tenant admission limit a call is refused with 429 + Retry-After: retry as a client does.
        for _ in range(60):
            r = httpx.post(f"{url}/v1/prefixes", json={"document": doc}, headers=_h(), timeout=300)
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("retry-after", "1")))
        results.append(r.json())

    threads = [threading.Thread(target=prefill) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len({r["prefix_id"] for r in results}) == 1
    assert sum(not r["cached"] for r in results) == 1  # exactly one forward pass
    pid = results[0]["prefix_id"]
    client = KVClient(f"grpc://{topo.worker_addr}", api_key=KEYS["alice"])
    outs: list[str] = []
    errors: list[BaseException] = []

    def gen() -> None:
        try:
            outs.append(client.generate(" The vault code is", prefix=pid, max_new_tokens=4).text)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=gen) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(outs) == 16 and len(set(outs)) == 1
    store = KVStore(StoreConfig(home=topo.home, metadata_url=topo_redis_url(topo)))
    assert store.leases(pid) == []  # every generation released its lease
    lease = pb_grpc.KVStoreStub(grpc.insecure_channel(topo.store_addr)).AcquireLease(
        pb.AcquireLeaseRequest(prefix_id=pid, holder="test", ttl_s=30), metadata=ALICE_AT_STORE)
    assert [x.lease_id for x in store.leases(pid)] == [lease.lease_id]
    assert pb_grpc.KVStoreStub(grpc.insecure_channel(topo.store_addr)).ReleaseLease(
        lease, metadata=ALICE_AT_STORE).released
    assert store.leases(pid) == []


def topo_redis_url(topo) -> str:
    return next(a for a in topo.procs["store"].args if str(a).startswith("redis://"))


def test_restarting_store_and_redis_loses_no_prefix(topo, redis: RedisServer) -> None:
    url = topo.gateway_url
    before = {p["prefix_id"] for p in httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"]}
    assert before
    redis.restart()
    old = topo.procs["store"]
    stop(old)
    topo.procs["store"], topo.logs["store"] = start("store-restarted", list(old.args[2:]), old_env(), topo.home.parent)
    wait_grpc(topo.store_addr, topo.procs["store"], topo.logs["store"])
    after = {p["prefix_id"] for p in httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"]}
    assert after == before
    pid = sorted(before)[0]
    r = httpx.post(f"{url}/v1/prefixes/{pid}/generate", json={"query": QUERIES[0], "max_new_tokens": 3},
                   headers=_h(), timeout=120)
    assert r.status_code == 200, r.text


def test_redis_flushed_then_store_restarted_loses_no_prefix(topo, redis: RedisServer) -> None:
    """Redis without persistence loses everything: the restarted store registers every prefix again from its
    directory, and each answers."""
    url = topo.gateway_url
    r = httpx.post(f"{url}/v1/prefixes", json={"document": DOC + " Flush edition."}, headers=_h(), timeout=120)
    assert r.status_code in (200, 201), r.text
    before = {p["prefix_id"] for p in httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"]}
    assert before
    flush = redis_client.Redis.from_url(redis.url)
    flush.flushall()
    flush.close()
    assert httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"] == []  # the index is gone
    old = topo.procs["store"]
    stop(old)
    topo.procs["store"], topo.logs["store"] = start("store-flushed", list(old.args[2:]), old_env(), topo.home.parent)
    wait_grpc(topo.store_addr, topo.procs["store"], topo.logs["store"])
    after = {p["prefix_id"] for p in httpx.get(f"{url}/v1/prefixes", headers=_h()).json()["prefixes"]}
    assert after == before
    for pid in sorted(before):
        r = httpx.post(f"{url}/v1/prefixes/{pid}/generate", json={"query": QUERIES[0], "max_new_tokens": 3},
                       headers=_h(), timeout=120)
        assert r.status_code == 200, r.text


def old_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **ENV}
