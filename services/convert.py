"""Conversions between store dataclasses and protobuf messages."""

from __future__ import annotations

from services.gen import kvstash_pb2 as pb
from store.manifest import Manifest
from workers.engine import GenerationStats


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
