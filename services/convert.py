"""Every conversion between kvstash values (manifests, requests, generation counters) and protobuf messages."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from services.gen import kvstash_pb2 as pb
from store.manifest import Manifest
from workers.requests import (
    LIMITS,
    QUERY_PAGES,
    DecodeConfig,
    GenerateRequest,
    GenerationStats,
    PrefillRequest,
    SamplingParams,
)

HTTP_OF_GRPC = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
                grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DATA_LOSS: 500, grpc.StatusCode.CANCELLED: 499}
"""The HTTP status of a gRPC status that carries no ``HTTP_STATUS_TRAILER`` (500 when absent). One gRPC
code can stand for several typed errors (RESOURCE_EXHAUSTED: too large, 413, or over a quota, 429): the
trailer, which kvstash's servers set from the typed error, tells them apart."""
HTTP_STATUS_TRAILER = "x-kvstash-http-status"
"""Trailing metadata of a gRPC error raised on purpose by a kvstash server: the HTTP status of its typed error."""
GENERIC_MESSAGES = {grpc.StatusCode.UNAVAILABLE: "service unavailable, try again later",
                    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out",
                    grpc.StatusCode.CANCELLED: "the request was cancelled",
                    grpc.StatusCode.RESOURCE_EXHAUSTED: "message too large",
                    grpc.StatusCode.DATA_LOSS: "stored data failed verification"}
"""What a gateway says for a gRPC error no kvstash server raised on purpose (the transport's own words
name internal addresses)."""
MAX_RELAYED_MESSAGE_CHARS = 300
RETRY_AFTER_TRAILER = "retry-after"
"""Trailing metadata of a refusal worth retrying (capacity pressure): the seconds to wait."""
DOCUMENT_CHUNK_CHARS = 1 << 20
"""Characters per streamed Prefill message (far under the gRPC message limit)."""


def http_status_of(e: grpc.RpcError) -> int:
    """The HTTP status of a gRPC error: its typed error's (the trailer), else by code."""
    for key, value in e.trailing_metadata() or ():
        if key == HTTP_STATUS_TRAILER and str(value).isdigit() and 400 <= int(value) <= 599:
            return int(value)
    return HTTP_OF_GRPC.get(e.code(), 500)


def relayed_error(e: grpc.RpcError) -> tuple[int, str, str]:
    """(HTTP status, message, code name) a gateway answers for an upstream gRPC error.

    A kvstash server's own 4xx error keeps its (short) message; anything else (a refused connection, a
    refused service credential, a server-side failure) gets a generic one: never internal addresses or paths.
    """
    code: grpc.StatusCode = e.code()
    status = http_status_of(e)
    if status < 500 and any(k == HTTP_STATUS_TRAILER for k, _ in e.trailing_metadata() or ()):
        message = e.details() or code.name.lower()
        if len(message) > MAX_RELAYED_MESSAGE_CHARS:
            message = message[:MAX_RELAYED_MESSAGE_CHARS - 3] + "..."
        return status, message, code.name
    if code == grpc.StatusCode.UNAUTHENTICATED:  # an upstream refused the gateway itself: not the caller's fault
        return 503, GENERIC_MESSAGES[grpc.StatusCode.UNAVAILABLE], grpc.StatusCode.UNAVAILABLE.name
    return status, GENERIC_MESSAGES.get(code, "internal error"), code.name


def retry_after_of(e: grpc.RpcError) -> str | None:
    """The retry-after hint (whole seconds) a server attached to an error, if any."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_TRAILER and str(value).isdigit():
            return str(value)
    return None


def document_chunks(document: str) -> Iterator[pb.PrefillChunk]:
    """A document as the Prefill client stream."""
    for i in range(0, max(1, len(document)), DOCUMENT_CHUNK_CHARS):
        yield pb.PrefillChunk(text=document[i:i + DOCUMENT_CHUNK_CHARS])


def prefill_chunks(req: PrefillRequest) -> Iterator[pb.PrefillChunk]:
    """A prefill request as the Prefill client stream (its options ride on the first chunk)."""
    for i, chunk in enumerate(document_chunks(req.document)):
        if i == 0:
            chunk.compress.extend(req.compress)
        yield chunk


def generate_request_to_pb(req: GenerateRequest) -> pb.GenerateRequest:
    """A GenerateRequest message; optional fields left unset where the request leaves them to the default."""
    d, s = req.decode, req.sampling
    d.check_wire_settings()
    msg = pb.GenerateRequest(prefix_id=req.prefix_id, query=req.query, method=req.method,
                             max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                             stop=list(s.stop), raw=req.raw, gen_len=d.gen_len)
    if d.budget is not None:
        msg.budget = d.budget
    if d.budget_tokens is not None:
        msg.budget_tokens = d.budget_tokens
    if d.ratio is not None:
        msg.ratio = d.ratio
    if d.query_pages != QUERY_PAGES[0]:
        msg.query_pages = d.query_pages
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def generate_request_from_pb(msg: pb.GenerateRequest) -> GenerateRequest:
    """The request a GenerateRequest message describes (zero or unset fields take their defaults)."""
    return GenerateRequest(
        prefix_id=msg.prefix_id, query=msg.query, method=msg.method or LIMITS.method_default, raw=msg.raw,
        decode=DecodeConfig(budget=msg.budget if msg.HasField("budget") else None,
                            budget_tokens=msg.budget_tokens if msg.HasField("budget_tokens") else None,
                            ratio=msg.ratio if msg.HasField("ratio") else None,
                            gen_len=msg.gen_len or LIMITS.gen_len_default,
                            query_pages=msg.query_pages if msg.HasField("query_pages") else QUERY_PAGES[0]),
        sampling=SamplingParams(max_new_tokens=msg.max_new_tokens or LIMITS.max_new_tokens_default,
                                temperature=msg.temperature,
                                top_p=msg.top_p if msg.HasField("top_p") else LIMITS.top_p_default,
                                seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop)))


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    """A store manifest as a protobuf message."""
    lay = m.layout
    return pb.Manifest(
        prefix_id=m.prefix_id, model_name=m.model_name, model_fingerprint=m.key.model_fingerprint,
        n_tokens=m.n_tokens,
        layout=pb.KVLayout(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype,
                           page_size=lay.page_size),
        files=[pb.FileInfo(name=f.name, size=f.size, blake2b=f.blake2b) for f in m.files],
        artifacts=[pb.ArtifactInfo(name=a.name, size=a.size, blake2b=a.blake2b) for a in m.artifacts],
        state=m.state, created_at=m.created_at, kv_bytes=m.kv_bytes, manifest_json=m.to_json(),
    )


def manifest_from_pb(msg: pb.Manifest) -> Manifest:
    """The store manifest carried by a protobuf message."""
    return Manifest.from_json(msg.manifest_json)


def stats_to_pb(st: GenerationStats) -> pb.GenerationStats:
    """Generation counters as a protobuf message."""
    return pb.GenerationStats(steps=st.steps, prompt_tokens=st.prompt_tokens, new_tokens=st.new_tokens,
                              bytes_fetched=st.bytes_fetched, bytes_full=st.bytes_full, seconds=st.seconds,
                              finish_reason=st.finish_reason, extra=st.extra)


def stats_from_pb(msg: pb.GenerationStats) -> GenerationStats:
    """Generation counters from a protobuf message."""
    return GenerationStats(steps=msg.steps, prompt_tokens=msg.prompt_tokens, new_tokens=msg.new_tokens,
                           bytes_fetched=msg.bytes_fetched, bytes_full=msg.bytes_full, seconds=msg.seconds,
                           finish_reason=msg.finish_reason, extra=dict(msg.extra))
