"""The KV-store gRPC service in process: TLS, tenancy, pins, page streaming, stats."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from services.auth import ApiKeys
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig, channel
from services.store_server import build_store_server
from store.kvstore import KVStore
from tests.services_harness import free_port
from tests.test_store import _write

KEYS = ApiKeys.parse("ka:alice,kb:bob")
ALICE = [("x-api-key", "ka")]


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _alice_prefix(store: KVStore) -> str:
    pid, _ = _write(store, 70)
    m = store.manifest(pid)
    # _write commits as tenant "default"; re-commit the same manifest under alice for these tests.
    arts = {a.name: store.meta.artifact(pid, a.name) or b"" for a in m.artifacts}
    store.meta.commit(replace(m, tenant="alice"), arts)
    return pid


@pytest.fixture()
def tls_server(store: KVStore, tmp_path: Path):
    cert, key = _self_signed(tmp_path)
    cfg = ServerConfig(port=free_port(), tls_cert=cert, tls_key=key)
    server, _ = build_store_server(store, cfg, KEYS)
    server.start()
    yield cfg, cert
    server.stop(0)


def test_tls_store_service(tls_server, store: KVStore) -> None:
    cfg, cert = tls_server
    pid = _alice_prefix(store)
    stub = pb_grpc.KVStoreStub(channel(f"localhost:{cfg.port}", tls_ca=cert))
    m = stub.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=ALICE, timeout=10)
    assert m.n_tokens == 70 and m.layout.page_size == 16

    plain = pb_grpc.KVStoreStub(grpc.insecure_channel(f"localhost:{cfg.port}"))
    with pytest.raises(grpc.RpcError) as e:
        plain.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=ALICE, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    # Pages stream back byte-identical to a local read, in request order.
    pages = [0, 2, 3, 4]
    chunks = list(stub.ReadPages(pb.ReadPagesRequest(prefix_id=pid, layer=1, kv_head=1, pages=pages, verify=True),
                                 metadata=ALICE))
    got = b"".join(c.data for c in chunks)
    lay = store.manifest(pid).layout
    ref = torch.empty(len(pages), lay.page_bytes, dtype=torch.uint8)
    store.read_pages(pid, 1, 1, pages, ref)
    assert got == ref.numpy().tobytes() and sum(c.n_pages for c in chunks) == len(pages)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ReadPages(pb.ReadPagesRequest(prefix_id=pid, layer=0, kv_head=0, pages=[3, 1]), metadata=ALICE))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # Pins: visible in usage, survive eviction pressure, and another tenant cannot touch them.
    assert stub.Pin(pb.PinRequest(prefix_id=pid, pinned=True), metadata=ALICE).pinned
    assert tuple(store.evict_to(0).evicted) == () and store.exists(pid)
    with pytest.raises(grpc.RpcError) as e:
        stub.Pin(pb.PinRequest(prefix_id=pid, pinned=False), metadata=[("x-api-key", "kb")])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.Pin(pb.PinRequest(prefix_id=pid, pinned=False), metadata=ALICE).pinned

    st = stub.Stats(pb.StatsRequest(), metadata=ALICE)
    assert st.n_prefixes == 1 and st.kv_bytes == store.manifest(pid).kv_bytes
    assert stub.Stats(pb.StatsRequest(), metadata=[("x-api-key", "kb")]).n_prefixes == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=0), metadata=ALICE)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
