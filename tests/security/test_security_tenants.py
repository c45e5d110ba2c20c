"""Tenant B against tenant A through the tenant surfaces: REST, the OpenAI routes, the worker's gRPC API.

Every attack on A's prefix is answered exactly as a missing prefix is (404 / NOT_FOUND, the same words),
and A's prefix stays intact and answering.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from services.auth import API_KEY_HEADER, SERVICE_TOKEN_HEADER, TENANT_HEADER
from services.gen import kvstash_pb2 as pb
from store.errors import PrefixNotFound
from tests.security.conftest import KEY_A, KEY_B, QUERY, TOKEN, System, bearer

MISSING = "0123456789abcdef" * 2
"""A well-formed id no tenant has."""


def _same_as_missing(system: System, send: Any) -> None:
    """``send(prefix_id)`` answers for A's id what it answers for a missing id (ids aside), and that is a 404."""
    hit, miss = send(system.pid_a), send(MISSING)
    assert hit.status_code == miss.status_code == 404, (hit.text, miss.text)
    assert hit.text.replace(system.pid_a, MISSING) == miss.text


REST_ATTACKS = {
    "get": lambda gw, pid: gw.get(f"/v1/prefixes/{pid}", headers=bearer(KEY_B)),
    "generate": lambda gw, pid: gw.post(f"/v1/prefixes/{pid}/generate", headers=bearer(KEY_B),
                                        json={"query": QUERY, "max_new_tokens": 2}),
    "generate-sse": lambda gw, pid: gw.post(f"/v1/prefixes/{pid}/generate", headers=bearer(KEY_B),
                                            json={"query": QUERY, "max_new_tokens": 2, "stream": True}),
    "delete": lambda gw, pid: gw.delete(f"/v1/prefixes/{pid}", headers={"X-API-Key": KEY_B}),
}
OPENAI_ATTACKS = {
    "completions": lambda gw, pid: gw.post("/v1/completions", headers=bearer(KEY_B),
                                           json={"prompt": QUERY, "prefix_id": pid, "max_tokens": 2}),
    "completions-json-prompt": lambda gw, pid: gw.post("/v1/completions", headers=bearer(KEY_B), json={
        "prompt": json.dumps({"prefix_id": pid, "query": QUERY}), "max_tokens": 2}),
    "completions-sse": lambda gw, pid: gw.post("/v1/completions", headers=bearer(KEY_B), json={
        "prompt": QUERY, "prefix_id": pid, "max_tokens": 2, "stream": True}),
    "chat": lambda gw, pid: gw.post("/v1/chat/completions", headers=bearer(KEY_B), json={
        "messages": [{"role": "user", "content": QUERY}], "prefix_id": pid, "max_tokens": 2}),
    "chat-sse": lambda gw, pid: gw.post("/v1/chat/completions", headers=bearer(KEY_B), json={
        "messages": [{"role": "user", "content": QUERY}], "prefix_id": pid, "max_tokens": 2, "stream": True}),
}


@pytest.mark.parametrize("attack", sorted(REST_ATTACKS))
def test_rest_tenant_b_cannot_reach_a(system: System, attack: str) -> None:
    _same_as_missing(system, lambda pid: REST_ATTACKS[attack](system.gateway, pid))
    listed = system.gateway.get("/v1/prefixes", headers=bearer(KEY_B)).json()["prefixes"]
    assert listed == []
    system.assert_a_intact()


@pytest.mark.parametrize("attack", sorted(OPENAI_ATTACKS))
def test_openai_routes_tenant_b_cannot_reach_a(system: System, attack: str) -> None:
    _same_as_missing(system, lambda pid: OPENAI_ATTACKS[attack](system.gateway, pid))
    system.assert_a_intact()


def test_rest_without_a_valid_key_is_401(system: System) -> None:
    for headers in ({}, bearer("not-a-key"), {"X-API-Key": "not-a-key"}, bearer(TOKEN.token)):
        for r in (system.gateway.get("/v1/prefixes", headers=headers),
                  system.gateway.get(f"/v1/prefixes/{system.pid_a}", headers=headers),
                  system.gateway.post("/v1/completions", headers=headers,
                                      json={"prompt": QUERY, "prefix_id": system.pid_a})):
            assert r.status_code == 401, (headers, r.text)
    system.assert_a_intact()


WORKER_ATTACKS = {
    "Generate": lambda w, pid, md: list(w.Generate(pb.GenerateRequest(prefix_id=pid, query=QUERY, max_new_tokens=2),
                                                   metadata=md, timeout=30)),
    "GetManifest": lambda w, pid, md: w.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=md, timeout=30),
    "DeletePrefix": lambda w, pid, md: w.DeletePrefix(pb.PrefixRef(prefix_id=pid), metadata=md, timeout=30),
}
# B naming A in the headers the store trusts (with and without the real service token): the worker reads
# only the API key.
IMPERSONATIONS = {
    "b": [(API_KEY_HEADER, KEY_B)],
    "b-claims-a": [(API_KEY_HEADER, KEY_B), (TENANT_HEADER, "tenant-a")],
    "b-claims-a-with-token": [(API_KEY_HEADER, KEY_B), (TENANT_HEADER, "tenant-a"),
                              (SERVICE_TOKEN_HEADER, TOKEN.token)],
}


@pytest.mark.parametrize("who", sorted(IMPERSONATIONS))
@pytest.mark.parametrize("rpc", sorted(WORKER_ATTACKS))
def test_worker_grpc_tenant_b_cannot_reach_a(system: System, rpc: str, who: str) -> None:
    answers = []
    for pid in (system.pid_a, MISSING):
        with pytest.raises(grpc.RpcError) as e:
            WORKER_ATTACKS[rpc](system.worker, pid, IMPERSONATIONS[who])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
        answers.append(e.value.details().replace(pid, "<id>"))
    assert answers[0] == answers[1]
    listed = system.worker.ListPrefixes(pb.ListPrefixesRequest(), metadata=IMPERSONATIONS[who], timeout=30)
    assert list(listed.prefixes) == []
    system.assert_a_intact()


def test_worker_grpc_needs_a_tenant_key(system: System) -> None:
    for md in ([], [(API_KEY_HEADER, "garbage")], [(SERVICE_TOKEN_HEADER, TOKEN.token), (TENANT_HEADER, "tenant-a")],
               [(API_KEY_HEADER, TOKEN.token)]):
        for rpc in ("GetManifest", "Generate"):
            with pytest.raises(grpc.RpcError) as e:
                WORKER_ATTACKS[rpc](system.worker, system.pid_a, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
    # A, with its own key, gets its prefix from the worker alone.
    m = system.worker.GetManifest(pb.PrefixRef(prefix_id=system.pid_a), metadata=[(API_KEY_HEADER, KEY_A)])
    assert m.manifest_json == system.manifest_json_a
    listed = system.worker.ListPrefixes(pb.ListPrefixesRequest(), metadata=[(API_KEY_HEADER, KEY_A)])
    assert [p.prefix_id for p in listed.prefixes] == [system.pid_a]
    system.assert_a_intact()


def test_a_hit_on_another_tenants_id_and_a_miss_take_one_path(system: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """No timing oracle: the same metadata reads, parses and checks, and the same error, for both."""
    import store.kvstore as kvstore_module
    from store.manifest import Manifest

    calls: list[str] = []

    def counting(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(kvstore_module, "tenant_salt", counting("salt", kvstore_module.tenant_salt))
    monkeypatch.setattr(kvstore_module.hmac, "compare_digest", counting("compare", kvstore_module.hmac.compare_digest))
    monkeypatch.setattr(Manifest, "from_json", classmethod(counting("parse", Manifest.from_json.__func__)))
    meta = system.store._meta
    monkeypatch.setattr(meta, "manifest", counting("get", meta.manifest))
    paths, errors = [], []
    for pid in (system.pid_a, MISSING):
        calls.clear()
        with pytest.raises(PrefixNotFound) as e:
            system.store.visible(pid, "tenant-b", secret="tenant-salt-secret")
        paths.append(list(calls))
        errors.append(str(e.value).replace(pid, "<id>"))
    assert paths[0] == paths[1] and {"get", "parse", "salt", "compare"} <= set(paths[0])
    assert errors[0] == errors[1]
    calls.clear()
    assert system.store.visible(system.pid_a, "tenant-a", secret="tenant-salt-secret").prefix_id == system.pid_a
    assert calls == paths[0]  # and A's own hit is the same walk
