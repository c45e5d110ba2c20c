"""Conversions between store dataclasses and protobuf messages."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from services.gen import kvstash_pb2 as pb
from store.manifest import Manifest
from workers.requests import GenerationStats

HTTP_OF_GRPC = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
                grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DATA_LOSS: 500, grpc.StatusCode.CANCELLED: 499}
"""The HTTP status a gateway or remote client reports for a gRPC status (500 when absent)."""
DOCUMENT_CHUNK_CHARS = 1 << 20
"""Characters per streamed Prefill message (far under the gRPC message limit)."""


def document_chunks(document: str) -> Iterator[pb.PrefillChunk]:
    """A document as the Prefill client stream."""
    for i in range(0, max(1, len(document)), DOCUMENT_CHUNK_CHARS):
        yield pb.PrefillChunk(text=document[i:i + DOCUMENT_CHUNK_CHARS])


def generate_request(prefix_id: str, query: str, method: str, budget: float | None, max_new: int,
                     temperature: float, top_p: float, seed: int | None, stop: list[str], raw: bool,
                     gen_len: int = 1) -> pb.GenerateRequest:
    """A GenerateRequest with only the optional fields that were given set."""
    req = pb.GenerateRequest(prefix_id=prefix_id, query=query, method=method, max_new_tokens=max_new,
                             temperature=temperature, top_p=top_p, stop=stop, raw=raw, gen_len=gen_len)
    if budget is not None:
        req.budget = budget
    if seed is not None:
        req.seed = seed
    return req


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


def stats_to_dict(st: pb.GenerationStats) -> dict:
    """Generation counters (protobuf) as a JSON-ready dict."""
    return {"steps": st.steps, "prompt_tokens": st.prompt_tokens, "new_tokens": st.new_tokens,
            "bytes_fetched": st.bytes_fetched, "bytes_full": st.bytes_full, "seconds": st.seconds,
            "finish_reason": st.finish_reason, **dict(st.extra)}
