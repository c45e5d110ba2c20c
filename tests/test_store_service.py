"""The KV-store gRPC service in process: TLS, tenancy, pins, page streaming, stats (called as a service)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from services.auth import ServiceToken
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig, channel
from services.store_server import build_store_server
from store.kvstore import KVStore
from tests.services_harness import free_port
from tests.test_store import HOSTILE_IDS, _write

TOKEN = ServiceToken("service-token-for-tests")
ALICE = TOKEN.metadata("alice")
BOB = TOKEN.metadata("bob")


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _alice_prefix(store: KVStore) -> str:
    return _write(store, 70, tenant="alice")[0]


@pytest.fixture()
def tls_server(store: KVStore, tmp_path: Path):
    cert, key = _self_signed(tmp_path)
    cfg = ServerConfig(port=free_port(), tls_cert=cert, tls_key=key)
    server, _ = build_store_server(store, cfg, TOKEN)
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
        stub.Pin(pb.PinRequest(prefix_id=pid, pinned=False), metadata=BOB)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.Pin(pb.PinRequest(prefix_id=pid, pinned=False), metadata=ALICE).pinned

    st = stub.Stats(pb.StatsRequest(), metadata=ALICE)
    assert st.n_prefixes == 1 and st.kv_bytes == store.manifest(pid).kv_bytes
    assert stub.Stats(pb.StatsRequest(), metadata=BOB).n_prefixes == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=0), metadata=ALICE)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _write_stream(store_src: KVStore, pid: str, *, commit: bool = True, chunk: int = 5000) -> list[pb.WriteChunk]:
    """The write stream that recreates ``pid`` (read back from ``store_src``) on another store."""
    m = store_src.manifest(pid)
    lay = m.layout
    msgs = [pb.WriteChunk(header=pb.WriteHeader(
        model_fingerprint=m.key.model_fingerprint, model_name=m.model_name, token_hash=m.key.token_hash,
        n_tokens=m.n_tokens, summarizers=[f"{n}:{v}" for n, v in m.key.summarizers],
        layout=pb.KVLayout(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
                           page_size=lay.page_size)))]
    for layer, f in enumerate(m.files):
        data = (store_src.prefix_dir(pid) / f.name).read_bytes()
        msgs += [pb.WriteChunk(layer=pb.LayerChunk(layer=layer, offset=o, data=data[o:o + chunk]))
                 for o in range(0, len(data), chunk)]
    msgs.append(pb.WriteChunk(artifact=pb.NamedBytes(name="extra", data=b"hello")))
    if commit:
        msgs.append(pb.WriteChunk(commit=True))
    return msgs


def test_write_prefix_stream(store: KVStore, tmp_path: Path) -> None:
    from store.config import StoreConfig

    src = KVStore(StoreConfig(home=tmp_path / "src"))
    pid_src, kv = _write(src, 70)
    cfg = ServerConfig(port=free_port())
    server, _ = build_store_server(store, cfg, TOKEN, secret="s")
    server.start()
    try:
        stub = pb_grpc.KVStoreStub(grpc.insecure_channel(cfg.address))
        # Without commit, the write aborts and leaves nothing behind.
        with pytest.raises(grpc.RpcError) as e:
            stub.WritePrefix(iter(_write_stream(src, pid_src, commit=False)), metadata=ALICE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "without commit" in e.value.details()
        assert store.list_prefixes() == [] and list(store.prefixes_dir.iterdir()) == []
        # Out-of-order bytes are refused.
        bad = _write_stream(src, pid_src)
        bad[1], bad[2] = bad[2], bad[1]
        with pytest.raises(grpc.RpcError) as e:
            stub.WritePrefix(iter(bad), metadata=ALICE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        m = stub.WritePrefix(iter(_write_stream(src, pid_src)), metadata=ALICE)
        # The server salts the id with the caller's tenant: alice's prefix is not the source's.
        assert m.prefix_id != pid_src and m.n_tokens == 70
        for layer, (k, v) in enumerate(kv):
            k2, v2 = store.read_layer(m.prefix_id, layer, verify=True)
            assert torch.equal(k2, k) and torch.equal(v2, v)
        assert store.artifact(m.prefix_id, "extra") == b"hello" and store.manifest(m.prefix_id).tenant == "alice"
        again = stub.WritePrefix(iter(_write_stream(src, pid_src)), metadata=ALICE)
        assert again.prefix_id == m.prefix_id and len(store.list_prefixes()) == 1
        with pytest.raises(grpc.RpcError) as e:
            stub.WritePrefix(iter([pb.WriteChunk(commit=True)]), metadata=ALICE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(0)
        src.close()


HOSTILE_RPCS = {
    "GetManifest": lambda stub, p: stub.GetManifest(pb.PrefixRef(prefix_id=p), metadata=ALICE),
    "DeletePrefix": lambda stub, p: stub.DeletePrefix(pb.PrefixRef(prefix_id=p), metadata=ALICE),
    "AcquireLease": lambda stub, p: stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=p, ttl_s=5), metadata=ALICE),
    "ReleaseLease": lambda stub, p: stub.ReleaseLease(pb.Lease(prefix_id=p, lease_id=f"{p}.0123456789abcdef"),
                                                      metadata=ALICE),
    "Pin": lambda stub, p: stub.Pin(pb.PinRequest(prefix_id=p, pinned=True), metadata=ALICE),
    "ReadPages": lambda stub, p: list(stub.ReadPages(pb.ReadPagesRequest(prefix_id=p, layer=0, kv_head=0, pages=[0]),
                                                     metadata=ALICE)),
}


@pytest.fixture()
def plain_stub(store: KVStore):
    cfg = ServerConfig(port=free_port())
    server, _ = build_store_server(store, cfg, TOKEN)
    server.start()
    yield pb_grpc.KVStoreStub(grpc.insecure_channel(cfg.address))
    server.stop(0)


@pytest.mark.parametrize("rpc", sorted(HOSTILE_RPCS))
def test_hostile_prefix_ids_are_invalid_argument(plain_stub, store: KVStore, rpc: str) -> None:
    _alice_prefix(store)
    for name, bad in HOSTILE_IDS.items():
        with pytest.raises(grpc.RpcError) as e:
            HOSTILE_RPCS[rpc](plain_stub, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        assert len(e.value.details()) < 100, name  # the huge id is not echoed back


def test_release_lease_of_another_prefix_is_invalid(plain_stub, store: KVStore) -> None:
    pid = _alice_prefix(store)
    lease = plain_stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=5), metadata=ALICE)
    for lease_id in ("", "nodot", f"{'0' * 32}.0123456789abcdef"):
        with pytest.raises(grpc.RpcError) as e:
            plain_stub.ReleaseLease(pb.Lease(prefix_id=pid, lease_id=lease_id), metadata=ALICE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert plain_stub.ReleaseLease(lease, metadata=ALICE).released and store.leases(pid) == []
