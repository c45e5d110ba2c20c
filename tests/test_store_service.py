"""The KV-store gRPC service in process: mutual TLS, tenancy, pins, page streaming, stats (called as a service)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
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
from store.limits import MAX_HOLDER_BYTES, MAX_TOKENS
from tests.services_harness import free_port
from tests.test_store import HOSTILE_IDS, _write
from tests.tls_certs import TestCA

TOKEN = ServiceToken("service-token-for-tests")
ALICE = TOKEN.metadata("alice")
BOB = TOKEN.metadata("bob")


def _alice_prefix(store: KVStore) -> str:
    return _write(store, 70, tenant="alice")[0]


@pytest.fixture()
def tls_server(store: KVStore, tmp_path: Path):
    ca = TestCA.make(tmp_path / "ca")
    cfg = ServerConfig(port=free_port(), tls=ca.tls("server", "serverAuth"))
    server, _ = build_store_server(store, cfg, TOKEN)
    server.start()
    yield cfg, ca.tls("client", "clientAuth")
    server.stop(0)


def test_tls_store_service(tls_server, store: KVStore) -> None:
    cfg, client_tls = tls_server
    pid = _alice_prefix(store)
    stub = pb_grpc.KVStoreStub(channel(f"localhost:{cfg.port}", client_tls))
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


# -- bounds: nothing is allocated or created for a request out of bounds ---------------------------
def _header(n_tokens: int, **layout: int) -> pb.WriteChunk:
    lay = {"n_layers": 3, "n_kv_heads": 2, "head_dim": 16, "page_size": 16, **layout}
    return pb.WriteChunk(header=pb.WriteHeader(model_fingerprint="fp", model_name="m", token_hash="t" * 64,
                                               n_tokens=n_tokens, layout=pb.KVLayout(dtype="float32", **lay)))


@pytest.mark.parametrize(("header", "code"), [
    (_header(1 << 40), grpc.StatusCode.INVALID_ARGUMENT),
    (_header(MAX_TOKENS + 1), grpc.StatusCode.INVALID_ARGUMENT),
    (_header(64, n_layers=1 << 30), grpc.StatusCode.INVALID_ARGUMENT),
    (_header(64, head_dim=1 << 20), grpc.StatusCode.INVALID_ARGUMENT),
    (_header(MAX_TOKENS, n_layers=1024, n_kv_heads=1024), grpc.StatusCode.RESOURCE_EXHAUSTED),  # no such disk
], ids=["n_tokens_2^40", "n_tokens_over_max", "n_layers", "head_dim", "more_than_the_disk"])
def test_write_out_of_bounds_leaves_nothing(plain_stub, store: KVStore, header: pb.WriteChunk,
                                            code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as e:
        plain_stub.WritePrefix(iter([header, pb.WriteChunk(commit=True)]), metadata=ALICE, timeout=30)
    assert e.value.code() == code, e.value.details()
    assert list(store.prefixes_dir.iterdir()) == [] and list(store.locks_dir.iterdir()) == []


def test_lease_holder_over_the_cap_is_invalid(plain_stub, store: KVStore) -> None:
    pid = _alice_prefix(store)
    with pytest.raises(grpc.RpcError) as e:
        plain_stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=5, holder="h" * (MAX_HOLDER_BYTES + 1)),
                                metadata=ALICE)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 100
    assert store.leases(pid) == []
    ok = plain_stub.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=5, holder="h" * MAX_HOLDER_BYTES),
                                 metadata=ALICE)
    assert [x.holder for x in store.leases(pid)] == ["h" * MAX_HOLDER_BYTES] and ok.lease_id


def test_tenant_quota_is_resource_exhausted(tmp_path: Path) -> None:
    from store.config import StoreConfig

    src = KVStore(StoreConfig(home=tmp_path / "src", fsync=False))
    first, second = _write(src, 40, seed=0)[0], _write(src, 40, seed=1)[0]
    store = KVStore(StoreConfig(home=tmp_path / "home", fsync=False, max_prefixes_per_tenant=1))
    cfg = ServerConfig(port=free_port())
    server, _ = build_store_server(store, cfg, TOKEN)
    server.start()
    try:
        stub = pb_grpc.KVStoreStub(grpc.insecure_channel(cfg.address))
        stub.WritePrefix(iter(_write_stream(src, first)), metadata=ALICE)
        with pytest.raises(grpc.RpcError) as e:
            stub.WritePrefix(iter(_write_stream(src, second)), metadata=ALICE)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in e.value.details()
        stub.WritePrefix(iter(_write_stream(src, second)), metadata=BOB)  # bob has room
        assert len(store.list_prefixes()) == 2 and not any(p.name.startswith(".tmp") for p in
                                                           store.prefixes_dir.iterdir())
    finally:
        server.stop(0)
        src.close()
        store.close()


def _wait_for(cond, what: str, timeout_s: float = 20.0) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_write_streams_to_disk_and_a_cancelled_stream_leaves_nothing(plain_stub, store: KVStore) -> None:
    """Layer bytes reach their page file while the stream is still open (memory stays bounded), and a client
    that goes away mid-layer leaves no file behind."""
    n_tokens, chunk = 16 * 64, 32 << 10
    layer_bytes = 2 * 64 * 4096  # 2 kv heads x 64 pages x 4 KiB

    def temp_files() -> list[Path]:
        return [f for d in store.prefixes_dir.iterdir() for f in d.glob("layer_*.kv")]

    on_disk: list[int] = []

    def stream() -> Iterator[pb.WriteChunk]:
        yield _header(n_tokens)
        for off in range(0, layer_bytes // 2, chunk):
            yield pb.WriteChunk(layer=pb.LayerChunk(layer=0, offset=off, data=bytes([off // chunk]) * chunk))
        with contextlib.suppress(AssertionError):
            _wait_for(lambda: sum(f.stat().st_size for f in temp_files()) >= layer_bytes // 2 - chunk,
                      "half a layer on disk", timeout_s=10)
        on_disk.append(sum(f.stat().st_size for f in temp_files()))
        raise RuntimeError("client gives up")  # the RPC is cancelled mid-layer

    with pytest.raises(grpc.RpcError) as e:
        plain_stub.WritePrefix(stream(), metadata=ALICE, timeout=60)
    assert e.value.code() == grpc.StatusCode.UNKNOWN  # the client's own exception
    assert on_disk[0] >= layer_bytes // 2 - chunk, "the server held the layer's bytes instead of writing them"
    _wait_for(lambda: list(store.prefixes_dir.iterdir()) == [], "the temp dir to go")
    assert store.list_prefixes() == []


# -- artifacts in chunks: larger than one message, bounded memory, checked offsets ----------------
def _artifact_chunks(name: str, data: bytes, chunk: int) -> list[pb.WriteChunk]:
    return [pb.WriteChunk(artifact=pb.NamedBytes(name=name, offset=o, data=data[o:o + chunk]))
            for o in range(0, max(len(data), 1), chunk)]


@pytest.fixture()
def src_prefix(tmp_path: Path) -> Iterator[tuple[KVStore, str]]:
    from store.config import StoreConfig

    src = KVStore(StoreConfig(home=tmp_path / "src", fsync=False))
    yield src, _write(src, 70)[0]
    src.close()


def _layers_and(src_prefix: tuple[KVStore, str], *middle: pb.WriteChunk, commit: bool = True) -> list[pb.WriteChunk]:
    """``src_prefix``'s write stream with ``middle`` in place of its one-message artifact."""
    msgs = [m for m in _write_stream(*src_prefix, commit=commit) if m.WhichOneof("part") != "artifact"]
    return msgs[:-1] + [*middle, msgs[-1]] if commit else [*msgs, *middle]


def test_artifact_larger_than_a_message_is_written_in_chunks(plain_stub, store: KVStore,
                                                              src_prefix: tuple[KVStore, str]) -> None:
    """An artifact past the gRPC message cap arrives in chunks and reads back identical, with the digest
    ``put_artifact`` gives; a one-message artifact (an older client) still works beside it."""
    from services.grpc_common import MAX_MESSAGE_BYTES
    from store.artifacts import digest

    big = os.urandom(MAX_MESSAGE_BYTES + (1 << 20) + 3)
    with pytest.raises(grpc.RpcError) as e:  # why chunks: one message cannot carry it
        plain_stub.WritePrefix(iter(_layers_and(src_prefix, *_artifact_chunks("big", big, len(big)))),
                               metadata=ALICE, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and store.list_prefixes() == []
    msgs = _layers_and(src_prefix, pb.WriteChunk(artifact=pb.NamedBytes(name="big", data=b"an older version")),
                       *_artifact_chunks("big", big, 4 << 20),
                       pb.WriteChunk(artifact=pb.NamedBytes(name="small", data=b"hello")))
    m = plain_stub.WritePrefix(iter(msgs), metadata=ALICE, timeout=60)
    info = store.manifest(m.prefix_id).artifact("big")
    assert info is not None and info.size == len(big) and info.blake2b == digest(big)
    assert store.artifact(m.prefix_id, "big") == big and store.artifact(m.prefix_id, "small") == b"hello"
    assert [a.name for a in m.artifacts] == ["big", "page_crc", "small"]
    store.verify(m.prefix_id)


def test_artifact_past_the_budget_is_refused_mid_stream(plain_stub, store: KVStore, src_prefix: tuple[KVStore, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk that takes an artifact past the prefix's budget fails the write: nothing of it is committed."""
    from store import limits

    monkeypatch.setattr(limits, "MIN_ARTIFACT_BUDGET", 1 << 20)
    released, ended = threading.Event(), threading.Event()

    def chunks() -> Iterator[pb.WriteChunk]:
        yield from _layers_and(src_prefix, *_artifact_chunks("big", b"x" * (2 << 20), 64 << 10), commit=False)
        released.wait(30)  # the stream stays open: the refusal cannot wait for its end
        ended.set()

    try:
        with pytest.raises(grpc.RpcError) as e:
            plain_stub.WritePrefix(chunks(), metadata=ALICE, timeout=60)
        assert not ended.is_set(), "refused only once the stream ended"
    finally:
        released.set()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most" in e.value.details()
    assert len(e.value.details()) < 300
    _wait_for(lambda: list(store.prefixes_dir.iterdir()) == [], "the temp dir to go")
    assert store.list_prefixes() == []


BAD_ARTIFACT_SEQUENCES = {
    "gap": [("a", 0, 10), ("a", 20, 10)],
    "rewind": [("a", 0, 10), ("a", 5, 10)],
    "repeat": [("a", 0, 10), ("a", 10, 10), ("a", 10, 10)],
    "not-starting-at-0": [("a", 7, 10)],
    "negative": [("a", 0, 10), ("a", -10, 10)],
    "interleaved": [("a", 0, 10), ("b", 0, 10), ("a", 10, 10)],
    "other-name-continuing": [("a", 0, 10), ("b", 10, 10)],
    "after-a-layer": [("a", 0, 10), "layer", ("a", 10, 10)],
}


@pytest.mark.parametrize("case", sorted(BAD_ARTIFACT_SEQUENCES))
def test_artifact_chunks_that_do_not_continue_are_refused(plain_stub, store: KVStore,
                                                          src_prefix: tuple[KVStore, str], case: str) -> None:
    msgs = _layers_and(src_prefix)
    layer_msgs = [m for m in msgs if m.WhichOneof("part") == "layer"]
    last_layer = msgs.index(layer_msgs[-1])
    middle = [layer_msgs[-1] if step == "layer" else
              pb.WriteChunk(artifact=pb.NamedBytes(name=step[0], offset=step[1], data=b"z" * step[2]))
              for step in BAD_ARTIFACT_SEQUENCES[case]]
    # The artifacts go before the last layer chunk ("after-a-layer" sends that chunk between them).
    stream = msgs[:last_layer] + middle + ([] if case == "after-a-layer" else [layer_msgs[-1]]) + msgs[last_layer + 1:]
    with pytest.raises(grpc.RpcError) as e:
        plain_stub.WritePrefix(iter(stream), metadata=ALICE, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "does not continue" in e.value.details() and len(e.value.details()) < 200
    _wait_for(lambda: list(store.prefixes_dir.iterdir()) == [], "the temp dir to go")
    assert store.list_prefixes() == []


def test_cancelled_artifact_stream_is_on_disk_as_it_comes_and_leaves_nothing(
        plain_stub, store: KVStore, src_prefix: tuple[KVStore, str]) -> None:
    """Artifact bytes reach their staged file while the stream is open, and a client that goes away
    mid-artifact leaves no file behind."""
    chunk, n_chunks = 256 << 10, 16
    on_disk: list[int] = []

    def staged() -> int:
        return sum(f.stat().st_size for d in store.prefixes_dir.iterdir() for f in d.glob(".artifact-*"))

    def stream() -> Iterator[pb.WriteChunk]:
        yield from _layers_and(src_prefix, commit=False)
        for i in range(n_chunks):
            yield pb.WriteChunk(artifact=pb.NamedBytes(name="big", offset=i * chunk, data=bytes([i]) * chunk))
        with contextlib.suppress(AssertionError):
            _wait_for(lambda: staged() >= (n_chunks - 1) * chunk, "the artifact on disk", timeout_s=10)
        on_disk.append(staged())
        raise RuntimeError("client gives up")  # the RPC is cancelled mid-artifact

    with pytest.raises(grpc.RpcError) as e:
        plain_stub.WritePrefix(stream(), metadata=ALICE, timeout=60)
    assert e.value.code() == grpc.StatusCode.UNKNOWN  # the client's own exception
    assert on_disk[0] >= (n_chunks - 1) * chunk, "the server held the artifact's bytes instead of writing them"
    _wait_for(lambda: list(store.prefixes_dir.iterdir()) == [], "the temp dir to go")
    assert store.list_prefixes() == []
