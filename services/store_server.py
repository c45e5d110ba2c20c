"""The KV-store gRPC server: manifests, listing, deletion, leases, page reads, stats."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from services.auth import ApiKeys
from services.convert import manifest_to_pb
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig, build_server, mapped_errors, serve_forever, tenant_of
from store.config import StoreConfig, default_home
from store.errors import InvalidInput, PrefixNotFound
from store.kvstore import KVStore
from store.manifest import Manifest
from store.metadata import lease_prefix

MAX_LEASE_TTL_S = 3600.0
READ_CHUNK_BYTES = 4 << 20
"""Bytes of pages per streamed chunk (well under the gRPC message limit)."""


class KVStoreService(pb_grpc.KVStoreServicer):
    """gRPC face of a ``KVStore``; every call is scoped to the caller's tenant."""

    def __init__(self, store: KVStore, keys: ApiKeys):
        self.store, self.keys = store, keys

    def _visible(self, context: grpc.ServicerContext, prefix_id: str) -> Manifest:
        tenant = tenant_of(context, self.keys)
        m = self.store.meta.manifest(prefix_id)
        if m is None or m.tenant != tenant:  # another tenant's prefix looks exactly like a missing one
            raise PrefixNotFound(f"no prefix {prefix_id!r}")
        return m

    def GetManifest(self, request: pb.PrefixRef, context: grpc.ServicerContext) -> pb.Manifest:
        """The manifest of a prefix."""
        with mapped_errors(context):
            return manifest_to_pb(self._visible(context, request.prefix_id))
        raise AssertionError("unreachable")

    def ListPrefixes(self, request: pb.ListPrefixesRequest, context: grpc.ServicerContext) -> pb.ListPrefixesResponse:
        """The caller's prefixes, newest first."""
        with mapped_errors(context):
            tenant = tenant_of(context, self.keys)
            return pb.ListPrefixesResponse(
                prefixes=[manifest_to_pb(m) for m in self.store.list_prefixes() if m.tenant == tenant])
        raise AssertionError("unreachable")

    def DeletePrefix(self, request: pb.PrefixRef, context: grpc.ServicerContext) -> pb.DeletePrefixResponse:
        """Delete a prefix and its files."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            self.store.remove(request.prefix_id)
            return pb.DeletePrefixResponse(prefix_id=request.prefix_id)
        raise AssertionError("unreachable")

    def AcquireLease(self, request: pb.AcquireLeaseRequest, context: grpc.ServicerContext) -> pb.Lease:
        """Pin a prefix against eviction for ``ttl_s`` seconds (renew by acquiring again)."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            if not 0 < request.ttl_s <= MAX_LEASE_TTL_S:
                raise InvalidInput(f"ttl_s must be in (0, {MAX_LEASE_TTL_S}]")
            lease_id = self.store.meta.acquire_lease(request.prefix_id, request.holder or context.peer(),
                                                     request.ttl_s)
            return pb.Lease(prefix_id=request.prefix_id, lease_id=lease_id, ttl_s=request.ttl_s)
        raise AssertionError("unreachable")

    def ReleaseLease(self, request: pb.Lease, context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        """Release a lease early (leases also expire on their own)."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            if lease_prefix(request.lease_id) != request.prefix_id:
                raise InvalidInput("lease_id does not belong to prefix_id")
            return pb.ReleaseLeaseResponse(released=self.store.meta.release_lease(request.lease_id))
        raise AssertionError("unreachable")

    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        """Pin (or unpin) a prefix against eviction."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            if request.pinned:
                self.store.meta.pin(request.prefix_id)
            else:
                self.store.meta.unpin(request.prefix_id)
            usage = self.store.meta.prefix_usage(request.prefix_id)
            return pb.PinResponse(prefix_id=request.prefix_id, pinned=bool(usage and usage.pinned))
        raise AssertionError("unreachable")

    def ReadPages(self, request: pb.ReadPagesRequest, context: grpc.ServicerContext) -> Iterator[pb.PageChunk]:
        """Stream the requested pages of one (layer, kv head) in bounded chunks."""
        with mapped_errors(context):
            m = self._visible(context, request.prefix_id)
            pages = list(request.pages)
            if pages != sorted(set(pages)):
                raise InvalidInput("pages must be sorted and unique")
            lay = m.layout
            if not (0 <= request.layer < lay.n_layers and 0 <= request.kv_head < lay.n_kv_heads):
                raise InvalidInput("layer or kv_head out of range")
            per_chunk = max(1, READ_CHUNK_BYTES // lay.page_bytes)
            for i in range(0, len(pages), per_chunk):
                part = pages[i:i + per_chunk]
                buf = torch.empty(len(part), lay.page_bytes, dtype=torch.uint8)
                self.store.read_pages(m.prefix_id, request.layer, request.kv_head, part, buf, verify=request.verify,
                                      manifest=m)
                yield pb.PageChunk(first_index=i, n_pages=len(part), data=buf.numpy().tobytes())

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StoreStats:
        """Counts and bytes of the caller's prefixes."""
        with mapped_errors(context):
            tenant = tenant_of(context, self.keys)
            ms = [m for m in self.store.list_prefixes() if m.tenant == tenant]
            return pb.StoreStats(n_prefixes=len(ms), kv_bytes=sum(m.kv_bytes for m in ms),
                                 artifact_bytes=sum(m.artifact_bytes for m in ms))
        raise AssertionError("unreachable")


def build_store_server(store: KVStore, cfg: ServerConfig, keys: ApiKeys) -> tuple[grpc.Server, object]:
    """A gRPC server exposing ``store`` (not yet started)."""
    service = KVStoreService(store, keys)
    name = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
    return build_server(cfg, [name], lambda s: pb_grpc.add_KVStoreServicer_to_server(service, s))


def main(argv: list[str] | None = None) -> None:
    """``python -m services.store_server``."""
    p = argparse.ArgumentParser(description="kvstash KV-store service (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--home", type=Path, default=None)
    p.add_argument("--metadata-url", default=None, help="redis://host:port/db (default: LMDB in the data dir)")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    store = KVStore(StoreConfig(home=args.home or default_home(), metadata_url=args.metadata_url))
    cfg = ServerConfig(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key)
    server, health = build_store_server(store, cfg, ApiKeys.from_env())
    serve_forever(server, health, "kvstash-store", cfg.address)


if __name__ == "__main__":
    main()
