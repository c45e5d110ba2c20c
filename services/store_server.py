"""The KV-store gRPC server: manifests, listing, deletion, leases, page reads, stats.

For services only (the gateway, workers): every call carries the service token and the tenant it acts
for; tenant API keys are refused. Tenants reach prefixes through the gateway or the worker.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from services.auth import SERVICE_TOKEN_ENV, ApiKeys, ServiceToken, service_token_or_exit, tenant_secret
from services.convert import manifest_to_pb
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig, build_server, mapped_errors, serve_forever, watch_health
from services.service_auth import ServiceTokenInterceptor, service_tenant
from services.store_flags import add_store_limit_args, store_limits
from services.tls import add_tls_args, tls_or_exit
from store.config import StoreConfig, default_home
from store.errors import InvalidInput
from store.kvstore import KVStore, PrefixWriter
from store.layout import KVLayout
from store.limits import MAX_SUMMARIZERS, check_holder, check_write
from store.manifest import Manifest
from store.prefix_key import PrefixKey, tenant_salt
from store.writer import ArtifactStream, LayerStream

MAX_LEASE_TTL_S = 3600.0
READ_CHUNK_BYTES = 4 << 20
"""Bytes of pages per streamed chunk (well under the gRPC message limit)."""


class KVStoreService(pb_grpc.KVStoreServicer):
    """gRPC face of a ``KVStore``; every call is scoped to the tenant the calling service names."""

    def __init__(self, store: KVStore, secret: str = ""):
        self.store, self.secret = store, secret

    def _visible(self, context: grpc.ServicerContext, prefix_id: str) -> Manifest:
        return self.store.visible(prefix_id, service_tenant(context))

    def WritePrefix(self, request_iterator: Iterator[pb.WriteChunk], context: grpc.ServicerContext) -> pb.Manifest:
        """Create, fill and commit a prefix from a client stream; anything short of ``commit`` aborts."""
        with mapped_errors(context):
            tenant = service_tenant(context)
            chunks = iter(request_iterator)
            first = next(chunks, None)
            if first is None or first.WhichOneof("part") != "header":
                raise InvalidInput("the first message of WritePrefix must be a header")
            key, n_tokens = self._key(first.header, tenant)
            check_write(key, n_tokens, first.header.model_name)  # bounds before any lock, file or buffer
            with self.store.prefill_lock(key.prefix_id):
                if (existing := self.store.find(key.prefix_id)) is not None:
                    return manifest_to_pb(existing)  # same bytes already stored: idempotent
                with self.store.write_prefix(key, model_name=first.header.model_name, n_tokens=n_tokens,
                                             tenant=tenant) as writer:
                    return manifest_to_pb(_fill(writer, chunks))
        raise AssertionError("unreachable")

    def _key(self, h: pb.WriteHeader, tenant: str) -> tuple[PrefixKey, int]:
        lay = h.layout
        if len(h.summarizers) > MAX_SUMMARIZERS:
            raise InvalidInput(f"at most {MAX_SUMMARIZERS} summarizers")
        layout = KVLayout(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
                          page_size=lay.page_size)
        if not h.model_fingerprint or not h.token_hash or h.n_tokens <= 0:
            raise InvalidInput("header needs model_fingerprint, token_hash and n_tokens > 0")
        try:
            summarizers = tuple((n, int(v)) for n, v in (x.rsplit(":", 1) for x in h.summarizers))
        except ValueError:
            raise InvalidInput("summarizers must be 'name:version'") from None
        key = PrefixKey(model_fingerprint=h.model_fingerprint, tenant_salt=tenant_salt(tenant, self.secret),
                        token_hash=h.token_hash, layout=layout, summarizers=summarizers)
        return key, int(h.n_tokens)

    def GetManifest(self, request: pb.PrefixRef, context: grpc.ServicerContext) -> pb.Manifest:
        """The manifest of a prefix."""
        with mapped_errors(context):
            return manifest_to_pb(self._visible(context, request.prefix_id))
        raise AssertionError("unreachable")

    def ListPrefixes(self, request: pb.ListPrefixesRequest, context: grpc.ServicerContext) -> pb.ListPrefixesResponse:
        """The caller's prefixes, newest first."""
        with mapped_errors(context):
            tenant = service_tenant(context)
            return pb.ListPrefixesResponse(
                prefixes=[manifest_to_pb(m) for m in self.store.list_prefixes(tenant)])
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
            holder = check_holder(request.holder or context.peer())
            lease_id = self.store.acquire_lease(request.prefix_id, holder, request.ttl_s)
            return pb.Lease(prefix_id=request.prefix_id, lease_id=lease_id, ttl_s=request.ttl_s)
        raise AssertionError("unreachable")

    def ReleaseLease(self, request: pb.Lease, context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        """Release a lease early (leases also expire on their own)."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            released = self.store.release_lease(request.lease_id, prefix_id=request.prefix_id)
            return pb.ReleaseLeaseResponse(released=released)
        raise AssertionError("unreachable")

    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        """Pin (or unpin) a prefix against eviction."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            if request.pinned:
                self.store.pin(request.prefix_id)
            else:
                self.store.unpin(request.prefix_id)
            usage = self.store.usage_of(request.prefix_id)
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
            crcs = self.store.page_crcs(m.prefix_id, m) if request.verify else None
            for i in range(0, len(pages), per_chunk):
                part = pages[i:i + per_chunk]
                buf = torch.empty(len(part), lay.page_bytes, dtype=torch.uint8)
                self.store.read_pages(m.prefix_id, request.layer, request.kv_head, part, buf, verify=request.verify,
                                      manifest=m, crcs=crcs)
                yield pb.PageChunk(first_index=i, n_pages=len(part), data=buf.numpy().tobytes())

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StoreStats:
        """Counts and bytes of the caller's prefixes."""
        with mapped_errors(context):
            tenant = service_tenant(context)
            ms = self.store.list_prefixes(tenant)
            return pb.StoreStats(n_prefixes=len(ms), kv_bytes=sum(m.kv_bytes for m in ms),
                                 artifact_bytes=sum(m.artifact_bytes for m in ms))
        raise AssertionError("unreachable")


def _fill(writer: PrefixWriter, chunks: Iterator[pb.WriteChunk]) -> Manifest:
    """Feed a write stream into ``writer``: layers' and artifacts' bytes arrive in order and go to their files
    as they come (memory stays bounded by one message whatever their size); each layer completes before commit.

    An artifact starts with a chunk at offset 0 and each next chunk continues it at the bytes received so far;
    one artifact is open at a time, and any other message (the next artifact's start included) closes it."""
    open_layers: dict[int, LayerStream] = {}
    artifact: ArtifactStream | None = None
    for chunk in chunks:
        part = chunk.WhichOneof("part")
        if part == "artifact" and chunk.artifact.offset != 0:
            a = chunk.artifact
            if artifact is None or a.name != artifact.name or a.offset != artifact.written:
                raise InvalidInput(f"artifact chunk at offset {a.offset} does not continue the open artifact"
                                   + (f" ({artifact.written} bytes received)" if artifact and a.name == artifact.name
                                      else " (each artifact starts at offset 0, one at a time)"))
            artifact.write(a.data)  # InvalidInput past the prefix's artifact budget
            continue
        if artifact is not None:
            artifact.close()
            artifact = None
        if part == "layer":
            c = chunk.layer
            stream = open_layers.get(c.layer)
            if stream is None:
                stream = open_layers[c.layer] = writer.open_layer(c.layer)  # InvalidInput: out of range or done
            if c.offset != stream.written or stream.written + len(c.data) > stream.size:
                raise InvalidInput(f"layer {c.layer}: chunk at offset {c.offset} does not continue the "
                                   f"{stream.written} bytes received (layer file is {stream.size} bytes)")
            stream.write(c.data)
            if stream.written == stream.size:
                open_layers.pop(c.layer).close()
        elif part == "artifact":
            artifact = writer.open_artifact(chunk.artifact.name)
            artifact.write(chunk.artifact.data)
        elif part == "commit" and chunk.commit:
            return writer.commit()
        else:
            raise InvalidInput(f"unexpected message {part!r} in the write stream")
    raise InvalidInput("the write stream ended without commit: nothing was stored")


def build_store_server(store: KVStore, cfg: ServerConfig, token: ServiceToken | None,
                       secret: str = "") -> tuple[grpc.Server, object]:
    """A gRPC server exposing ``store`` (not yet started); every call needs ``token`` (None: insecure, no check)."""
    service = KVStoreService(store, secret)
    name = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
    gate = [ServiceTokenInterceptor(token, f"/{name}/")] if token else []
    return build_server(cfg, [name], lambda s: pb_grpc.add_KVStoreServicer_to_server(service, s), gate)



def main(argv: list[str] | None = None) -> None:
    """``python -m services.store_server``."""
    p = argparse.ArgumentParser(description="kvstash KV-store service (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--home", type=Path, default=None)
    p.add_argument("--metadata-url", default=None, help="redis://host:port/db (default: LMDB in the data dir)")
    add_tls_args(p)
    p.add_argument("--insecure", action="store_true",
                   help=f"serve without {SERVICE_TOKEN_ENV} (every call trusted; loopback development only)")
    add_store_limit_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    token = service_token_or_exit("kvstash-store", args.insecure, "--insecure", ApiKeys.from_env())
    tls = tls_or_exit(args, "kvstash-store")
    store = KVStore(StoreConfig(home=args.home or default_home(), metadata_url=args.metadata_url,
                                **store_limits(args)))
    cfg = ServerConfig(host=args.host, port=args.port, tls=tls)
    server, health = build_store_server(store, cfg, token, tenant_secret())
    watch_health(health, [pb.DESCRIPTOR.services_by_name["KVStore"].full_name], store.usage)  # metadata reachable
    serve_forever(server, health, "kvstash-store", cfg.address, cfg.drain_s, close=store.close)


if __name__ == "__main__":
    main()
