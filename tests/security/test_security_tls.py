"""Mutual TLS on the gRPC services: only a client with a certificate from the deployment's CA gets a
connection, the service token is still required over it, and a partial or unusable TLS setting stops a
process at start-up instead of leaving it on plaintext."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from client import KVClient
from services import gateway as gateway_module
from services import store_server, worker_server
from services.auth import API_KEY_HEADER
from services.gateway import GatewayConfig, create_app
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import RECONNECT_OPTIONS, ServerConfig, channel
from services.healthcheck import check
from services.service_auth import REFUSED
from services.store_server import build_store_server
from services.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsConfig
from services.worker_server import build_worker_server
from store.config import StoreConfig
from store.kvstore import KVStore
from tests.security.conftest import KEY_A, KEYS, TOKEN, bearer
from tests.services_harness import REPO, free_port
from tests.test_store import _write
from tests.tls_certs import TestCA
from workers.engine import Worker

ALICE = TOKEN.metadata("tenant-a")
TLS_ENV = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)


@dataclass(frozen=True)
class Pki:
    """The deployment's CA with a server and a client identity, and a stranger's CA with a client identity."""

    server: TlsConfig
    client: TlsConfig
    stranger: TlsConfig
    """A client certificate from another CA (which it also trusts)."""
    other_ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ours, theirs = TestCA.make(tmp_path_factory.mktemp("ca")), TestCA.make(tmp_path_factory.mktemp("other-ca"))
    return Pki(server=ours.tls("server", "serverAuth"), client=ours.tls("client", "clientAuth"),
               stranger=theirs.tls("stranger", "clientAuth"), other_ca=theirs.cert)


@pytest.fixture(scope="module")
def mtls_store(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(address, tenant-a's prefix id) of a store gRPC server that wants mutual TLS and the service token."""
    store = KVStore(StoreConfig(home=tmp_path_factory.mktemp("mtls") / "home", page_size=16))
    pid = _write(store, 40, tenant="tenant-a")[0]
    cfg = ServerConfig(port=free_port(), tls=pki.server)
    server, _ = build_store_server(store, cfg, TOKEN)
    server.start()
    yield f"localhost:{cfg.port}", pid
    server.stop(0)
    store.close()


def _store(address: str, creds: grpc.ChannelCredentials | None = None) -> pb_grpc.KVStoreStub:
    ch = grpc.secure_channel(address, creds, RECONNECT_OPTIONS) if creds else grpc.insecure_channel(address)
    return pb_grpc.KVStoreStub(ch)


def _refused(stub: pb_grpc.KVStoreStub, pid: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stub.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=ALICE, timeout=5)
    return e.value


def test_client_with_our_certificate_and_the_token_is_served(mtls_store: tuple[str, str], pki: Pki) -> None:
    address, pid = mtls_store
    stub = pb_grpc.KVStoreStub(channel(address, pki.client))
    assert stub.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=ALICE, timeout=10).n_tokens == 40
    assert [m.prefix_id for m in stub.ListPrefixes(pb.ListPrefixesRequest(), metadata=ALICE).prefixes] == [pid]


def test_mtls_keeps_the_service_token_in_force(mtls_store: tuple[str, str], pki: Pki) -> None:
    """A certificate is not a credential on its own: without the token the call is still refused."""
    address, pid = mtls_store
    stub = pb_grpc.KVStoreStub(channel(address, pki.client))
    for md in ([], [(API_KEY_HEADER, KEY_A)], [("x-kvstash-tenant", "tenant-a")]):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and e.value.details() == REFUSED


def test_client_without_a_certificate_is_refused(mtls_store: tuple[str, str], pki: Pki) -> None:
    address, pid = mtls_store
    server_only = grpc.ssl_channel_credentials(root_certificates=pki.client.ca.read_bytes())  # one-way TLS
    assert _refused(_store(address, server_only), pid).code() == grpc.StatusCode.UNAVAILABLE


def test_client_with_another_cas_certificate_is_refused(mtls_store: tuple[str, str], pki: Pki) -> None:
    address, pid = mtls_store
    s = pki.stranger
    creds = grpc.ssl_channel_credentials(root_certificates=pki.client.ca.read_bytes(),  # trusts our server
                                         private_key=s.key.read_bytes(), certificate_chain=s.cert.read_bytes())
    assert _refused(_store(address, creds), pid).code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(mtls_store: tuple[str, str]) -> None:
    address, pid = mtls_store
    assert _refused(_store(address), pid).code() == grpc.StatusCode.UNAVAILABLE


def test_client_refuses_a_server_of_another_ca(mtls_store: tuple[str, str], pki: Pki) -> None:
    """Our client certificate, but trusting another CA: the client will not talk to this server."""
    address, pid = mtls_store
    wrong_trust = TlsConfig(cert=pki.client.cert, key=pki.client.key, ca=pki.other_ca)
    assert _refused(pb_grpc.KVStoreStub(channel(address, wrong_trust)), pid).code() == grpc.StatusCode.UNAVAILABLE


def test_healthcheck_speaks_mtls(mtls_store: tuple[str, str], pki: Pki) -> None:
    address, _ = mtls_store
    assert check(address, tls=pki.client)
    assert not check(address)  # plaintext gets no answer
    env = {**os.environ, TLS_CERT_ENV: str(pki.client.cert), TLS_KEY_ENV: str(pki.client.key),
           TLS_CA_ENV: str(pki.client.ca)}
    r = subprocess.run([sys.executable, "-m", "services.healthcheck", address], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]  # the compose healthcheck, with the container's TLS variables


# -- start-up: all three or none ----------------------------------------------------------------
@pytest.fixture()
def tls_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No TLS variable from the outside; a service token and keys so the TLS check is what refuses."""
    for name in TLS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSTASH_SERVICE_TOKEN", TOKEN.token)
    monkeypatch.setenv("KVSTASH_API_KEYS", f"{KEY_A}:tenant-a")
    return monkeypatch


def _store_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, started: list[grpc.Server]) -> list[str]:
    """store_server.main's arguments, with serving replaced by starting the server into ``started``."""
    def serve(server: grpc.Server, *_: object, **__: object) -> None:
        started.append(server)
        server.start()

    monkeypatch.setattr(store_server, "serve_forever", serve)
    monkeypatch.setattr(store_server, "watch_health", lambda *_: None)
    return ["--port", str(free_port()), "--home", str(tmp_path / "home")]


PARTIAL = {"cert only": ("cert",), "cert and key": ("cert", "key"), "ca only": ("ca",), "key and ca": ("key", "ca")}


@pytest.mark.parametrize("given", sorted(PARTIAL))
def test_partial_tls_config_refuses_to_start(tls_env: pytest.MonkeyPatch, tmp_path: Path, pki: Pki,
                                            given: str) -> None:
    started: list[grpc.Server] = []
    args = _store_main(tls_env, tmp_path, started)
    fields = PARTIAL[given]
    flags = [x for f in fields for x in (f"--tls-{f}", str(getattr(pki.server, f)))]
    with pytest.raises(SystemExit, match="mutual TLS needs .*missing --tls-"):
        store_server.main([*args, *flags])
    for f in fields:  # the same through the environment
        tls_env.setenv(f"KVSTASH_TLS_{f.upper()}", str(getattr(pki.server, f)))
    with pytest.raises(SystemExit, match="mutual TLS needs .*missing"):
        store_server.main(args)
    assert started == []


def test_unusable_tls_files_refuse_to_start(tls_env: pytest.MonkeyPatch, tmp_path: Path, pki: Pki) -> None:
    started: list[grpc.Server] = []
    args = _store_main(tls_env, tmp_path, started)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    s = pki.server
    cases = {"missing file": (tmp_path / "absent.pem", s.key, s.ca), "garbage cert": (garbage, s.key, s.ca),
             "key of another cert": (s.cert, pki.client.key, s.ca), "garbage ca": (s.cert, s.key, garbage)}
    for name, (cert, key, ca) in cases.items():
        with pytest.raises(SystemExit, match="kvstash-store: TLS ") as e:
            store_server.main([*args, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)])
        assert str(e.value), name
    assert started == []


def test_full_tls_config_serves_mtls_only(tls_env: pytest.MonkeyPatch, tmp_path: Path, pki: Pki) -> None:
    """All three from the environment: main's server wants our client certificate, and plaintext gets nothing."""
    started: list[grpc.Server] = []
    args = _store_main(tls_env, tmp_path, started)
    for name, path in zip(TLS_ENV, (pki.server.cert, pki.server.key, pki.server.ca), strict=True):
        tls_env.setenv(name, str(path))
    store_server.main(args)
    (server,) = started
    try:
        address = f"localhost:{args[1]}"
        served = pb_grpc.KVStoreStub(channel(address, pki.client))
        assert served.ListPrefixes(pb.ListPrefixesRequest(), metadata=ALICE, timeout=10).prefixes == []
        assert _refused(_store(address), "x").code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_partial_config_is_a_clean_exit_not_a_traceback(tmp_path: Path, pki: Pki) -> None:
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    r = subprocess.run([sys.executable, "-m", "services.store_server", "--insecure", "--home", str(tmp_path / "h"),
                        "--port", str(free_port())], cwd=REPO, env={**env, TLS_CERT_ENV: str(pki.server.cert)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"kvstash-store: mutual TLS needs a certificate, its key and a CA; missing --tls-key / {TLS_KEY_ENV}" \
           in r.stderr


def test_gateway_and_worker_refuse_a_partial_config(tls_env: pytest.MonkeyPatch, pki: Pki) -> None:
    tls_env.setattr("uvicorn.run", lambda app, **kw: pytest.fail("the gateway served"))
    tls_env.setenv(TLS_CA_ENV, str(pki.client.ca))
    with pytest.raises(SystemExit, match="kvstash-gateway: mutual TLS needs"):
        gateway_module.main([])
    with pytest.raises(SystemExit, match="kvstash-worker: mutual TLS needs"):  # before any model loads
        worker_server.main(["--port", str(free_port())])


# -- the gateway and remote clients over mTLS ---------------------------------------------------
def test_gateway_and_client_reach_mtls_worker_and_store(mtls_store: tuple[str, str], pki: Pki, worker: Worker,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store_addr, pid = mtls_store
    wcfg = ServerConfig(port=free_port(), tls=pki.server)
    server, _ = build_worker_server(worker, wcfg, KEYS)
    server.start()
    try:
        worker_addr = f"localhost:{wcfg.port}"
        gateway = TestClient(create_app(GatewayConfig(worker_addr=worker_addr, store_addr=store_addr,
                                                      tls=pki.client), KEYS, TOKEN))
        assert gateway.get("/readyz").json() == {"status": "ready", "worker": "SERVING", "store": "SERVING"}
        r = gateway.post("/v1/prefixes", json={"document": "A memo over mutual TLS."}, headers=bearer(KEY_A))
        assert r.status_code == 201, r.text
        listed = gateway.get("/v1/prefixes", headers=bearer(KEY_A)).json()["prefixes"]  # from the store, over mTLS
        assert [p["prefix_id"] for p in listed] == [pid]  # (this worker writes to a store of its own)
        for name, path in zip(TLS_ENV, (pki.client.cert, pki.client.key, pki.client.ca), strict=True):
            monkeypatch.setenv(name, str(path))
        assert r.json()["prefix_id"] in {m.prefix_id for m in KVClient(f"grpc://{worker_addr}", api_key=KEY_A).ls()}
        plain = create_app(GatewayConfig(worker_addr=worker_addr, store_addr=store_addr), KEYS, TOKEN)
        assert TestClient(plain).get("/readyz").status_code == 503  # a gateway without the certificate gets nowhere
    finally:
        server.stop(0)
