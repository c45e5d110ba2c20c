"""The boundary: no file is read for a caller, errors name no internal address, typed errors keep their
HTTP status across gRPC, and no server starts open by accident."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from client import KVClient
from client.backends import RemoteError
from services import gateway as gateway_module
from services import store_server
from services.auth import API_KEY_HEADER, ApiKeys, ServiceToken, require_api_keys
from services.gateway import GatewayConfig, create_app
from services.gen import kvstash_pb2 as pb
from store.errors import KVStashError, TooLarge
from tests.security.conftest import DOC_A, KEY_A, KEY_B, KEYS, TOKEN, System, bearer
from tests.services_harness import free_port
from workers.engine import Worker

PLANTED = "planted-secret-that-must-never-leave-the-server"
FILES = ["/proc/self/environ", "/etc/passwd", "../../proc/self/environ", "/proc/self/cwd/pyproject.toml"]
ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+|localhost|:\d{2,5}\b|ipv[46]")


def _raw_prefill_chunk(path: str) -> bytes:
    """A PrefillChunk as an old client would send it, with removed field 2 (file_path) set."""
    data = path.encode()
    return bytes([0x12, len(data)]) + data


@pytest.mark.parametrize("path", FILES)
def test_file_path_is_refused_on_every_surface(system: System, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTASH_PLANTED_SECRET", PLANTED)
    for body in ({"file_path": path}, {"document": "x", "file_path": path}):
        r = system.gateway.post("/v1/prefixes", json=body, headers=bearer(KEY_B))
        assert r.status_code == 400 and "file_path is not accepted" in r.json()["error"]["message"]
        assert PLANTED not in r.text
    prefill = grpc.insecure_channel(system.worker_addr).stream_unary("/kvstash.v1.Worker/Prefill")
    with pytest.raises(grpc.RpcError) as e:  # the field is gone: nothing but an empty document arrives
        prefill(iter([_raw_prefill_chunk(path)]), metadata=[(API_KEY_HEADER, KEY_B)], timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and PLANTED not in e.value.details()
    assert list(system.worker.ListPrefixes(pb.ListPrefixesRequest(), metadata=[(API_KEY_HEADER, KEY_B)]).prefixes) == []
    system.assert_a_intact()


def test_clients_read_files_themselves(system: System, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC_A, encoding="utf-8")
    client = KVClient(f"grpc://{system.worker_addr}", api_key=KEY_A)
    handle = client.prefill_file(doc)
    assert handle.prefix_id == system.pid_a and handle.cached  # the same text: A's prefix, found
    assert [m.prefix_id for m in client.ls()] == [system.pid_a]
    system.assert_a_intact()


def _no_address(text: str) -> None:
    assert not ADDRESS.search(text), text


def test_upstream_failures_name_no_internal_address() -> None:
    dead = f"127.0.0.1:{free_port()}"
    gw = TestClient(create_app(GatewayConfig(worker_addr=dead, store_addr=dead), KEYS, TOKEN))
    for r in (gw.get("/v1/prefixes", headers=bearer(KEY_A)),
              gw.get(f"/v1/prefixes/{'a' * 32}", headers=bearer(KEY_A)),
              gw.post(f"/v1/prefixes/{'a' * 32}/generate", headers=bearer(KEY_A), json={"query": "q"}),
              gw.post(f"/v1/prefixes/{'a' * 32}/generate", headers=bearer(KEY_A), json={"query": "q", "stream": True}),
              gw.post("/v1/completions", headers=bearer(KEY_A), json={"prompt": "q", "prefix_id": "a" * 32}),
              gw.post("/v1/prefixes", headers=bearer(KEY_A), json={"document": "d"})):
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {"message": "service unavailable, try again later", "code": "UNAVAILABLE"}
        _no_address(r.text)


def test_a_gateway_with_the_wrong_service_token_is_unavailable_not_401(system: System) -> None:
    gw = TestClient(create_app(GatewayConfig(worker_addr=system.worker_addr, store_addr=system.store_addr), KEYS,
                               ServiceToken("not-the-deployment-token")))
    r = gw.get("/v1/prefixes", headers=bearer(KEY_A))
    assert r.status_code == 503 and "token" not in r.text  # the caller's key was fine: not its problem
    system.assert_a_intact()


class _OverQuota(KVStashError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429


@pytest.mark.parametrize(("error", "status"), [(_OverQuota("tenant over its quota"), 429),
                                               (TooLarge("document over the limit"), 413)])
def test_typed_errors_keep_their_http_status_across_grpc(system: System, monkeypatch: pytest.MonkeyPatch,
                                                         error: KVStashError, status: int) -> None:
    """Both are RESOURCE_EXHAUSTED on the wire; the trailer tells the gateway and clients which."""
    def refuse(self: Worker, document: str, tenant: str = "default", **options: object) -> None:
        raise error

    monkeypatch.setattr(Worker, "prefill", refuse)
    r = system.gateway.post("/v1/prefixes", json={"document": "more"}, headers=bearer(KEY_A))
    assert r.status_code == status and r.json()["error"] == {"message": str(error), "code": "RESOURCE_EXHAUSTED"}
    with pytest.raises(RemoteError) as e:
        KVClient(f"grpc://{system.worker_addr}", api_key=KEY_A).prefill("more")
    assert e.value.http_status == status and e.value.grpc_code == "RESOURCE_EXHAUSTED"
    monkeypatch.undo()
    system.assert_a_intact()


# -- nothing starts open by accident ------------------------------------------------------------
@pytest.fixture()
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("KVSTASH_API_KEYS", "KVSTASH_SERVICE_TOKEN", "KVSTASH_INSECURE_NO_AUTH"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _gateway_runs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    import uvicorn

    ran: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(app))
    return ran


def test_gateway_refuses_to_start_open(bare_env: pytest.MonkeyPatch) -> None:
    ran = _gateway_runs(bare_env)
    with pytest.raises(SystemExit, match="KVSTASH_API_KEYS.*--insecure-no-auth"):
        gateway_module.main([])
    bare_env.setenv("KVSTASH_API_KEYS", f"{KEY_A}:tenant-a")
    with pytest.raises(SystemExit, match="KVSTASH_SERVICE_TOKEN"):
        gateway_module.main([])
    bare_env.setenv("KVSTASH_SERVICE_TOKEN", KEY_A + "-but-long-enough")
    gateway_module.main([])
    assert len(ran) == 1
    bare_env.setenv("KVSTASH_API_KEYS", f"{KEY_A + '-but-long-enough'}:tenant-a")
    with pytest.raises(SystemExit, match="differ from every tenant API key"):
        gateway_module.main([])
    bare_env.setenv("KVSTASH_SERVICE_TOKEN", "short")
    with pytest.raises(SystemExit, match="at least 16"):
        gateway_module.main([])


def test_gateway_insecure_only_when_asked(bare_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ran = _gateway_runs(bare_env)
    with caplog.at_level(logging.WARNING):
        gateway_module.main(["--insecure-no-auth"])
    bare_env.setenv("KVSTASH_INSECURE_NO_AUTH", "1")
    gateway_module.main([])
    assert len(ran) == 2 and "INSECURE" in caplog.text
    bare_env.setenv("KVSTASH_INSECURE_NO_AUTH", "true")  # only "1" counts
    with pytest.raises(SystemExit):
        gateway_module.main([])


def test_worker_refuses_to_start_open(bare_env: pytest.MonkeyPatch) -> None:
    from services import worker_server

    with pytest.raises(SystemExit, match="KVSTASH_API_KEYS.*--insecure-no-auth"):
        worker_server.main(["--port", str(free_port())])  # refused before any model or store is opened
    with pytest.raises(SystemExit):
        require_api_keys(ApiKeys(), insecure=False, server="kvstash-worker")
    require_api_keys(ApiKeys(), insecure=True, server="kvstash-worker")  # warns, starts


def test_store_refuses_to_start_without_a_service_token(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    served: list[str] = []
    bare_env.setattr(store_server, "serve_forever",
                     lambda server, health, name, address, *_, **__: served.append(address))
    bare_env.setattr(store_server, "watch_health", lambda *_: None)  # its thread would keep the store open
    args = ["--port", str(free_port()), "--home", str(tmp_path / "home")]
    with pytest.raises(SystemExit, match="KVSTASH_SERVICE_TOKEN.*--insecure"):
        store_server.main(args)
    bare_env.setenv("KVSTASH_SERVICE_TOKEN", TOKEN.token)
    bare_env.setenv("KVSTASH_API_KEYS", f"{TOKEN.token}:tenant-a")
    with pytest.raises(SystemExit, match="differ from every tenant API key"):
        store_server.main(args)
    bare_env.setenv("KVSTASH_API_KEYS", f"{KEY_A}:tenant-a")
    store_server.main(args)
    bare_env.delenv("KVSTASH_SERVICE_TOKEN")
    store_server.main([*args, "--insecure"])
    assert len(served) == 2
