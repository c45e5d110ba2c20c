"""The decode-worker gRPC server: Prefill (client-streaming), Generate (server-streaming), and the caller's
prefixes (list, manifest, delete), so tenants never need the store service."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.auth import ApiKeys, insecure_no_auth, require_api_keys, tenant_secret
from services.convert import generate_request_from_pb, manifest_to_pb, stats_to_pb
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig, build_server, mapped_errors, serve_forever, tenant_of, watch_health
from services.scheduler import FairScheduler, SchedulerConfig, Ticket
from services.store_flags import add_store_limit_args, store_limits
from services.tls import add_tls_args, tls_or_exit
from store.config import StoreConfig, default_home
from store.errors import InvalidInput, PrefixInUse, TooLarge
from store.kvstore import KVStore
from store.manifest import Manifest
from workers.engine import Worker
from workers.methods.registry import METHODS
from workers.model import load_model
from workers.model_source import default_device, default_dtype, default_model
from workers.offload.config import add_offload_args, offload_from_args
from workers.requests import LIMITS, GenerateRequest, GenerationStats, PrefillRequest

DEFAULT_MAX_DOCUMENT_BYTES = 64 << 20
DECODE_SERVICE = "\x00decode"
"""The scheduler name of the batched decode step (no tenant name holds a NUL)."""


@dataclass(frozen=True, kw_only=True)
class WorkerLimits:
    """Request limits of a worker (the bounds every request meets are ``workers.requests.LIMITS``)."""

    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    max_new_tokens_cap: int = LIMITS.max_new_tokens_cap
    """Most tokens one generation may ask for here (at most ``LIMITS.max_new_tokens_cap``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens_cap <= LIMITS.max_new_tokens_cap:
            raise ValueError(f"max_new_tokens_cap must be in [1, {LIMITS.max_new_tokens_cap}]")

    def admit(self, req: GenerateRequest) -> None:
        """Refuse a generation over this worker's token cap."""
        if req.sampling.max_new_tokens > self.max_new_tokens_cap:
            raise InvalidInput(f"max_new_tokens must be at most {self.max_new_tokens_cap} on this worker")


class WorkerService(pb_grpc.WorkerServicer):
    """Serves one model to bounded generations, batched in the worker's decode engine, and prefills in fair turns."""

    def __init__(self, worker: Worker, keys: ApiKeys, limits: WorkerLimits, scheduler: FairScheduler):
        self.worker, self.keys, self.limits, self.scheduler = worker, keys, limits, scheduler

    def Prefill(self, request_iterator: Iterator[pb.PrefillChunk], context: grpc.ServicerContext) -> pb.PrefillResponse:
        """Assemble the streamed document and prefill it (a cache hit does no forward pass)."""
        with mapped_errors(context):
            tenant = tenant_of(context, self.keys)
            req = self._read_request(request_iterator)
            # One turn for the whole prefill (and the scores it asks for): its forward pass is not split into steps.
            with self.scheduler.admit(tenant) as ticket, self._cancelled_with(context, ticket), \
                    self.scheduler.turn(ticket):
                r = self.worker.prefill(req.document, tenant=tenant, compress=req.compress)
            return pb.PrefillResponse(prefix_id=r.prefix_id, n_tokens=r.n_tokens, cached=r.cached)
        raise AssertionError("unreachable")

    def _read_request(self, chunks: Iterator[pb.PrefillChunk]) -> PrefillRequest:
        """The streamed document, and the options its first chunk carries."""
        parts, size, compress = [], 0, None
        for chunk in chunks:
            if compress is None:
                compress = tuple(chunk.compress)
            elif chunk.compress:
                raise InvalidInput("compress goes on the first chunk only")
            size += len(chunk.text.encode())
            if size > self.limits.max_document_bytes:
                raise TooLarge(f"document over {self.limits.max_document_bytes} bytes")
            parts.append(chunk.text)
        return PrefillRequest(document="".join(parts), compress=compress or ())

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateEvent]:
        """Stream the answer; stops at the next step when the client cancels or the deadline passes."""
        with mapped_errors(context):
            tenant = tenant_of(context, self.keys)
            req = generate_request_from_pb(request)
            self.limits.admit(req)
            with self.scheduler.admit(tenant) as ticket, self._cancelled_with(context, ticket):
                yield from self._generate(req, tenant, ticket, context)

    def _generate(self, req: GenerateRequest, tenant: str, ticket: Ticket,
                  context: grpc.ServicerContext) -> Iterator[pb.GenerateEvent]:
        stats = GenerationStats()
        t0 = time.perf_counter()

        with self.scheduler.turn(ticket):  # opening a method may run on the device (summaries, warm pages)
            pieces = self.worker.generate(req.prefix_id, req.query, req.sampling, method=req.method,
                                          decode=req.decode, tenant=tenant, stats=stats, raw=req.raw)
        if not context.add_callback(pieces.cancel):  # the client left: the engine drops it at its next step
            pieces.cancel()
        try:
            for piece in pieces:
                if not context.is_active():  # cancelled or past its deadline: stop decoding
                    return
                yield pb.GenerateEvent(text=piece, token=pb.TokenStats(
                    step=stats.steps, bytes_fetched=stats.bytes_fetched, seconds=time.perf_counter() - t0))
        finally:
            pieces.close()  # releases the lease and the fetch engines
        yield pb.GenerateEvent(done=stats_to_pb(stats))

    @staticmethod
    @contextlib.contextmanager
    def _cancelled_with(context: grpc.ServicerContext, ticket: Ticket) -> Iterator[None]:
        """Cancel ``ticket`` when the RPC ends early (client gone, deadline passed), so it stops at its next turn."""
        if not context.add_callback(ticket.cancel):
            ticket.cancel()  # already over
        yield

    def _visible(self, context: grpc.ServicerContext, prefix_id: str) -> Manifest:
        return self.worker.store.visible(prefix_id, tenant_of(context, self.keys), secret=self.worker.secret)

    def ListPrefixes(self, request: pb.ListPrefixesRequest, context: grpc.ServicerContext) -> pb.ListPrefixesResponse:
        """The caller's prefixes, newest first."""
        with mapped_errors(context):
            ms = self.worker.store.list_prefixes(tenant_of(context, self.keys), secret=self.worker.secret)
            return pb.ListPrefixesResponse(prefixes=[manifest_to_pb(m) for m in ms])
        raise AssertionError("unreachable")

    def GetManifest(self, request: pb.PrefixRef, context: grpc.ServicerContext) -> pb.Manifest:
        """The manifest of one of the caller's prefixes."""
        with mapped_errors(context):
            return manifest_to_pb(self._visible(context, request.prefix_id))
        raise AssertionError("unreachable")

    def DeletePrefix(self, request: pb.PrefixRef, context: grpc.ServicerContext) -> pb.DeletePrefixResponse:
        """Delete one of the caller's prefixes and its files."""
        with mapped_errors(context):
            self._visible(context, request.prefix_id)
            try:  # never under a generation's feet: refused atomically while one holds a lease
                self.worker.remove_prefix(request.prefix_id, unless_leased=True)
            except PrefixInUse as e:
                raise PrefixInUse(f"prefix {request.prefix_id} is in use by a generation; retry when it ends") from e
            return pb.DeletePrefixResponse(prefix_id=request.prefix_id)
        raise AssertionError("unreachable")

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.WorkerInfo:
        """The model this worker serves."""
        with mapped_errors(context):
            tenant_of(context, self.keys)
        lm = self.worker.lm
        return pb.WorkerInfo(model_name=lm.name, model_fingerprint=lm.fingerprint, max_context=lm.max_context,
                             methods=sorted(METHODS), device=str(lm.device))


def build_worker_server(worker: Worker, cfg: ServerConfig, keys: ApiKeys, limits: WorkerLimits | None = None,
                        scheduling: SchedulerConfig | None = None) -> tuple[grpc.Server, object]:
    """A gRPC server exposing ``worker`` (not yet started)."""
    scheduler = FairScheduler(scheduling)
    # The batched decode step serves every running generation at once: it takes the model's turns under
    # one name, alternating with prefills (and generations' opening turns) fairly in model time.
    worker.engine.turn = lambda: scheduler.service_turn(DECODE_SERVICE)
    service = WorkerService(worker, keys, limits or WorkerLimits(), scheduler)
    # Threads for every admitted call plus health checks and refusals: admission, not the pool, is the bound.
    cfg = dataclasses.replace(cfg, max_workers=max(cfg.max_workers, scheduler.config.max_active + 8))
    name = pb.DESCRIPTOR.services_by_name["Worker"].full_name
    return build_server(cfg, [name], lambda s: pb_grpc.add_WorkerServicer_to_server(service, s))


def main(argv: list[str] | None = None) -> None:
    """``python -m services.worker_server``."""
    p = argparse.ArgumentParser(description="kvstash decode worker (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--home", type=Path, default=None, help="shared data directory")
    p.add_argument("--metadata-url", default=None, help="redis://host:port/db (default: LMDB in the data dir)")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--max-document-bytes", type=int, default=DEFAULT_MAX_DOCUMENT_BYTES)
    p.add_argument("--max-new-tokens-cap", type=int, default=LIMITS.max_new_tokens_cap,
                   help=f"most tokens one generation may ask for (1 to {LIMITS.max_new_tokens_cap})")
    p.add_argument("--max-per-tenant", type=int, default=SchedulerConfig.max_per_tenant,
                   help="generations and prefills one tenant may run at once (more: RESOURCE_EXHAUSTED)")
    p.add_argument("--max-active", type=int, default=SchedulerConfig.max_active,
                   help="generations and prefills admitted at once, all tenants together")
    p.add_argument("--retry-after-seconds", type=int, default=SchedulerConfig.retry_after_s,
                   help="retry-after hint sent with a refusal")
    add_tls_args(p)
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve without KVSTASH_API_KEYS: every caller is tenant 'default' (local development only)")
    add_offload_args(p)
    add_store_limit_args(p)  # prefills write through this process's store
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    keys = ApiKeys.from_env()
    require_api_keys(keys, insecure_no_auth(args.insecure_no_auth), "kvstash-worker")
    tls = tls_or_exit(args, "kvstash-worker")  # before the model loads: a bad config fails in a second
    limits = WorkerLimits(max_document_bytes=args.max_document_bytes, max_new_tokens_cap=args.max_new_tokens_cap)
    store = KVStore(StoreConfig(home=args.home or default_home(), metadata_url=args.metadata_url, **store_limits(args)))
    device = args.device or default_device()
    lm = load_model(args.model or default_model(), device=device, dtype=default_dtype(device), progress=False)
    worker = Worker(store, lm, secret=tenant_secret(), progress=False, offload=offload_from_args(args))
    worker.host_tier()  # allocate and pin it now: pinning GBs takes seconds no request should wait for
    cfg = ServerConfig(host=args.host, port=args.port, tls=tls)
    scheduling = SchedulerConfig(max_per_tenant=args.max_per_tenant, max_active=args.max_active,
                                 retry_after_s=args.retry_after_seconds)
    server, health = build_worker_server(worker, cfg, keys, limits, scheduling)
    watch_health(health, [pb.DESCRIPTOR.services_by_name["Worker"].full_name], store.usage)  # metadata reachable
    serve_forever(server, health, "kvstash-worker", cfg.address, cfg.drain_s, close=store.close)


if __name__ == "__main__":
    main()
