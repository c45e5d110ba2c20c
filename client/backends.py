"""Where a KVClient's calls go: in-process (embedded), a gRPC worker, or the REST gateway.

Imports neither torch nor grpc: a backend imports its transport when it is made.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlparse

from store.errors import InvalidInput, KVStashError
from store.manifest import Manifest
from workers.requests import GenerateRequest, GenerationStats, PrefillRequest

if TYPE_CHECKING:
    from services.tls import TlsConfig


class Backend(Protocol):
    """The operations a KVClient needs, whatever is behind them."""

    def prefill(self, req: PrefillRequest) -> tuple[str, int, bool]:
        """(prefix_id, n_tokens, cached)."""
        ...

    def generate(self, req: GenerateRequest, stats: GenerationStats) -> Iterator[str]:
        """Text pieces of the answer; fills ``stats`` when done."""
        ...

    def list(self) -> list[Manifest]:
        """Visible prefixes, newest first."""
        ...

    def manifest(self, prefix_id: str) -> Manifest:
        """One prefix's manifest."""
        ...

    def remove(self, prefix_id: str) -> None:
        """Delete a prefix."""
        ...


class RemoteError(KVStashError):
    """An error reported by a kvstash server, with its status."""

    def __init__(self, message: str, grpc_code: str, http_status: int):
        super().__init__(message)
        self.grpc_code, self.http_status = grpc_code, http_status


def _remote_error(e: Any) -> RemoteError:
    from services.convert import http_status_of

    return RemoteError(e.details() or str(e), e.code().name, http_status_of(e))


class GrpcBackend:
    """``grpc://worker-host:port?api_key=...``: every call goes to the worker (the store service is for
    services only). A ``store=`` parameter, which older URLs carry, is accepted and ignored. Mutual TLS
    when ``tls`` is given or ``KVSTASH_TLS_CERT``/``_KEY``/``_CA`` are set (InvalidInput when unusable)."""

    def __init__(self, url: str, api_key: str | None = None, tls: TlsConfig | None = None):
        import grpc  # noqa: F401 - fail early when grpc is missing

        from services.gen import kvstash_pb2_grpc as pb_grpc
        from services.grpc_common import channel
        from services.tls import TlsConfig

        u = urlparse(url)
        key = api_key or parse_qs(u.query).get("api_key", [None])[0]
        self._md = [("x-api-key", key)] if key else []
        tls = tls or TlsConfig.from_env()
        self.worker = pb_grpc.WorkerStub(channel(u.netloc, tls.validate() if tls else None))

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        import grpc

        try:
            return fn(*args, metadata=self._md, **kw)
        except grpc.RpcError as e:
            raise _remote_error(e) from None

    def prefill(self, req: PrefillRequest) -> tuple[str, int, bool]:
        """Stream the document to the worker in chunks."""
        from services.convert import prefill_chunks

        r = self._call(self.worker.Prefill, prefill_chunks(req))
        return r.prefix_id, r.n_tokens, r.cached

    def generate(self, req: GenerateRequest, stats: GenerationStats) -> Iterator[str]:
        """Server-streamed pieces."""
        import grpc

        from services.convert import generate_request_to_pb, stats_from_pb

        msg = generate_request_to_pb(req)
        try:
            for ev in self.worker.Generate(msg, metadata=self._md):
                if ev.HasField("done"):
                    stats.copy_from(stats_from_pb(ev.done))
                else:
                    yield ev.text
        except grpc.RpcError as e:
            raise _remote_error(e) from None

    def list(self) -> list[Manifest]:
        """From the worker."""
        from services.convert import manifest_from_pb
        from services.gen import kvstash_pb2 as pb

        return [manifest_from_pb(m) for m in self._call(self.worker.ListPrefixes, pb.ListPrefixesRequest()).prefixes]

    def manifest(self, prefix_id: str) -> Manifest:
        """From the worker."""
        from services.convert import manifest_from_pb
        from services.gen import kvstash_pb2 as pb

        return manifest_from_pb(self._call(self.worker.GetManifest, pb.PrefixRef(prefix_id=prefix_id)))

    def remove(self, prefix_id: str) -> None:
        """Through the worker."""
        from services.gen import kvstash_pb2 as pb

        self._call(self.worker.DeletePrefix, pb.PrefixRef(prefix_id=prefix_id))


class HttpBackend:
    """``http://gateway:8000`` (REST + SSE)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _check(self, r: Any) -> Any:
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"message": r.text, "code": "UNKNOWN"}
            raise RemoteError(err.get("message", ""), err.get("code", "UNKNOWN"), r.status_code)
        return r.json()

    def prefill(self, req: PrefillRequest) -> tuple[str, int, bool]:
        """POST /v1/prefixes."""
        d = self._check(self.http.post("/v1/prefixes", json=req.to_json()))
        return d["prefix_id"], d["n_tokens"], d["cached"]

    def generate(self, req: GenerateRequest, stats: GenerationStats) -> Iterator[str]:
        """POST /v1/prefixes/{id}/generate with SSE streaming."""
        body = {**req.to_json(), "stream": True}
        with self.http.stream("POST", f"/v1/prefixes/{req.prefix_id}/generate", json=body) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            event = "message"
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event == "done":
                        stats.copy_from(GenerationStats.from_json(data))
                        return
                    if event == "error":
                        raise RemoteError(data.get("message", ""), data.get("code", "UNKNOWN"), 502)
                    yield data["text"]
                    event = "message"
        raise RemoteError("the gateway's stream ended before the answer was complete", "UNAVAILABLE", 502)

    def list(self) -> list[Manifest]:
        """GET /v1/prefixes."""
        rows = self._check(self.http.get("/v1/prefixes"))["prefixes"]
        return [self.manifest(r["prefix_id"]) for r in rows]

    def manifest(self, prefix_id: str) -> Manifest:
        """GET /v1/prefixes/{id}."""
        return Manifest.from_json(self._check(self.http.get(f"/v1/prefixes/{prefix_id}"))["manifest_json"])

    def remove(self, prefix_id: str) -> None:
        """DELETE /v1/prefixes/{id}."""
        self._check(self.http.delete(f"/v1/prefixes/{prefix_id}"))


def remote_backend(target: str, api_key: str | None) -> Backend:
    """The backend for a ``grpc://`` or ``http(s)://`` target."""
    scheme = urlparse(target).scheme
    if scheme == "grpc":
        return GrpcBackend(target, api_key)
    if scheme in ("http", "https"):
        return HttpBackend(target, api_key)
    raise InvalidInput(f"unsupported target {target!r}: use grpc://host:port, http(s)://host:port or embedded")
