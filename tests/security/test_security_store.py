"""The store's gRPC API is for services only: a tenant key, garbage or nothing is refused on every RPC,
in the same words; the tenant header counts only beside the service token.

The attack this closes: read A's layer-0 V pages with ``ReadPages`` and invert them with the shipped weights.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from services.auth import API_KEY_HEADER, SERVICE_TOKEN_HEADER, TENANT_HEADER
from services.gen import kvstash_pb2 as pb
from services.service_auth import REFUSED
from tests.security.conftest import KEY_A, KEY_B, TOKEN, System


def _write_stream(system: System) -> list[pb.WriteChunk]:
    """A write of A's prefix all over again (header, layer 0's first bytes, commit)."""
    m = system.store.manifest(system.pid_a)
    lay = m.layout
    header = pb.WriteHeader(model_fingerprint=m.key.model_fingerprint, model_name=m.model_name,
                            token_hash=m.key.token_hash, n_tokens=m.n_tokens,
                            layout=pb.KVLayout(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads,
                                               head_dim=lay.head_dim, dtype=lay.dtype, page_size=lay.page_size))
    return [pb.WriteChunk(header=header), pb.WriteChunk(layer=pb.LayerChunk(layer=0, offset=0, data=b"\0" * 64)),
            pb.WriteChunk(commit=True)]


STORE_RPCS = {
    "ReadPages": lambda s, pid, md, sys: list(s.ReadPages(
        pb.ReadPagesRequest(prefix_id=pid, layer=0, kv_head=0, pages=[0]), metadata=md, timeout=10)),
    "GetManifest": lambda s, pid, md, sys: s.GetManifest(pb.PrefixRef(prefix_id=pid), metadata=md, timeout=10),
    "WritePrefix": lambda s, pid, md, sys: s.WritePrefix(iter(_write_stream(sys)), metadata=md, timeout=10),
    "ListPrefixes": lambda s, pid, md, sys: s.ListPrefixes(pb.ListPrefixesRequest(), metadata=md, timeout=10),
    "DeletePrefix": lambda s, pid, md, sys: s.DeletePrefix(pb.PrefixRef(prefix_id=pid), metadata=md, timeout=10),
    "Pin": lambda s, pid, md, sys: s.Pin(pb.PinRequest(prefix_id=pid, pinned=False), metadata=md, timeout=10),
    "AcquireLease": lambda s, pid, md, sys: s.AcquireLease(pb.AcquireLeaseRequest(prefix_id=pid, ttl_s=5),
                                                           metadata=md, timeout=10),
    "ReleaseLease": lambda s, pid, md, sys: s.ReleaseLease(pb.Lease(prefix_id=pid, lease_id=f"{pid}.0123456789abcdef"),
                                                           metadata=md, timeout=10),
    "Stats": lambda s, pid, md, sys: s.Stats(pb.StatsRequest(), metadata=md, timeout=10),
}
CALLERS = {
    "nothing": [],
    "a-tenant-key": [(API_KEY_HEADER, KEY_A)],
    "a-tenant-key-naming-itself": [(API_KEY_HEADER, KEY_A), (TENANT_HEADER, "tenant-a")],
    "b-naming-a": [(API_KEY_HEADER, KEY_B), (TENANT_HEADER, "tenant-a")],
    "tenant-key-as-service-token": [(SERVICE_TOKEN_HEADER, KEY_A), (TENANT_HEADER, "tenant-a")],
    "garbage-token": [(SERVICE_TOKEN_HEADER, "x" * 40), (TENANT_HEADER, "tenant-a")],
    "token-prefix": [(SERVICE_TOKEN_HEADER, TOKEN.token[:-1]), (TENANT_HEADER, "tenant-a")],
    "two-tokens": [(SERVICE_TOKEN_HEADER, "x" * 40), (SERVICE_TOKEN_HEADER, TOKEN.token), (TENANT_HEADER, "tenant-a")],
}


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("rpc", sorted(STORE_RPCS))
def test_store_refuses_everything_but_the_service_token(system: System, rpc: str, caller: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        STORE_RPCS[rpc](system.store_stub, system.pid_a, CALLERS[caller], system)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert e.value.details() == REFUSED  # the same words for a valid tenant key and for garbage


def test_store_refusals_leave_a_intact(system: System) -> None:
    for rpc in ("WritePrefix", "DeletePrefix", "Pin", "AcquireLease"):
        for md in CALLERS.values():
            with pytest.raises(grpc.RpcError):
                STORE_RPCS[rpc](system.store_stub, system.pid_a, md, system)
    assert system.store.leases(system.pid_a) == []
    usage = system.store.usage_of(system.pid_a)
    assert usage is not None and not usage.pinned
    system.assert_a_intact()


def test_service_token_acts_only_for_the_tenant_it_names(system: System) -> None:
    as_b = TOKEN.metadata("tenant-b")
    for rpc in ("ReadPages", "GetManifest", "DeletePrefix", "Pin", "AcquireLease"):
        with pytest.raises(grpc.RpcError) as e:
            STORE_RPCS[rpc](system.store_stub, system.pid_a, as_b, system)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, rpc
    assert list(system.store_stub.ListPrefixes(pb.ListPrefixesRequest(), metadata=as_b).prefixes) == []
    with pytest.raises(grpc.RpcError) as e:  # the token alone names no tenant
        system.store_stub.GetManifest(pb.PrefixRef(prefix_id=system.pid_a),
                                      metadata=[(SERVICE_TOKEN_HEADER, TOKEN.token)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The gateway's own call, for A, works.
    m = system.store_stub.GetManifest(pb.PrefixRef(prefix_id=system.pid_a), metadata=TOKEN.metadata("tenant-a"))
    assert m.manifest_json == system.manifest_json_a
    system.assert_a_intact()


def test_store_refuses_before_reading_the_request(system: System) -> None:
    """A stranger's bytes are not even parsed: garbage is UNAUTHENTICATED, not a parse error."""
    call: Any = grpc.insecure_channel(system.store_addr).unary_unary("/kvstash.v1.KVStore/GetManifest")
    with pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff", metadata=[(API_KEY_HEADER, KEY_A)], timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_store_health_stays_open_for_orchestrators(system: System) -> None:
    from services.healthcheck import check

    assert check(system.store_addr)  # health is a separate service, without the token (compose checks it)
