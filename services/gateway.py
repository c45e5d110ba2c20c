"""The REST gateway (FastAPI): prefixes, generation with SSE, OpenAI-compatible completions."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.auth import (
    API_KEY_HEADER,
    SERVICE_TOKEN_ENV,
    ApiKeys,
    ServiceToken,
    bearer_key,
    insecure_no_auth,
    require_api_keys,
    service_metadata,
    service_token_or_exit,
)
from services.convert import (
    generate_request_to_pb,
    manifest_from_pb,
    prefill_chunks,
    relayed_error,
    retry_after_of,
    stats_from_pb,
)
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import channel
from services.http_calls import CancellingStream, run_unless_disconnected
from services.openapi_doc import document_api
from services.tls import TlsConfig, add_tls_args, tls_or_exit
from store.errors import InvalidInput, KVStashError, TooLarge
from workers.requests import (
    FILE_PATH_REFUSED,
    GENERATE_JSON_FIELDS,
    LIMITS,
    QUERY_PAGES,
    DecodeConfig,
    GenerateRequest,
    GenerationStats,
    PrefillRequest,
    SamplingParams,
    compress_names,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Where the gateway forwards, and its limits."""

    worker_addr: str = "127.0.0.1:50052"
    store_addr: str = "127.0.0.1:50051"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = 600.0
    health_timeout_s: float = 1.0
    """How long /readyz waits for each dependency's health answer."""
    tls: TlsConfig | None = None
    """Mutual TLS to the worker and the store (this certificate presented, theirs checked against its CA)."""


class PrefillBody(BaseModel):
    """POST /v1/prefixes: the document's text (the gateway and the worker read no files for a caller)."""

    model_config = ConfigDict(extra="forbid")
    document: str
    compress: list[str] = Field(default_factory=list, max_length=LIMITS.compress_max_count)
    """Compression methods (kvzip, hybridkv) whose scores the worker computes right after storing the prefix."""

    @field_validator("compress")
    @classmethod
    def _scorers(cls, names: list[str]) -> list[str]:
        try:
            return list(compress_names(names))
        except InvalidInput as e:  # pydantic's 422 with the reason, like every other out-of-bounds field
            raise ValueError(str(e)) from None

    @model_validator(mode="before")
    @classmethod
    def _no_file_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and "file_path" in data:
            raise InvalidInput(FILE_PATH_REFUSED)  # 400 with the reason, not pydantic's "extra field"
        return data


# Bounds and defaults below come from workers.requests.LIMITS; the request built from a body checks them again.
StopString = Annotated[str, StringConstraints(min_length=1, max_length=LIMITS.stop_max_chars)]
MaxNewTokens = Annotated[int, Field(ge=1, le=LIMITS.max_new_tokens_cap)]


class DecodeFields(BaseModel):
    """Method and sampling fields every generation endpoint takes."""

    method: str = Field(LIMITS.method_default, min_length=1, max_length=LIMITS.method_max_chars)
    budget: float | None = Field(None, gt=0, le=LIMITS.budget_max, allow_inf_nan=False)
    budget_tokens: int | None = Field(None, ge=1, le=LIMITS.budget_tokens_max)
    """KV entries per KV head a query-time cache (snapkv, lookahead) keeps."""
    ratio: float | None = Field(None, gt=0, le=LIMITS.ratio_max, allow_inf_nan=False)
    """Compression methods: the fraction of the prefix's KV pairs the compressed cache keeps."""
    temperature: float = Field(LIMITS.temperature_default, ge=0, le=LIMITS.temperature_max, allow_inf_nan=False)
    top_p: float = Field(LIMITS.top_p_default, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=LIMITS.seed_max)
    stream: bool = False
    gen_len: int = Field(LIMITS.gen_len_default, ge=1, le=LIMITS.gen_len_max)
    """Steps the one-time φ fetch is amortized over when matching the budget (appendix D)."""
    query_pages: Literal[QUERY_PAGES] = QUERY_PAGES[0]  # type: ignore[valid-type]
    """Page methods: each query token selects its own pages ("token") or a query chunk shares one selection
    ("shared": fewer reads before the first token)."""


class GenerateBody(DecodeFields):
    """POST /v1/prefixes/{id}/generate."""

    model_config = ConfigDict(extra="forbid")
    query: str = Field(max_length=LIMITS.query_max_chars)
    max_new_tokens: MaxNewTokens = LIMITS.max_new_tokens_default
    stop: list[StopString] = Field(default_factory=list, max_length=LIMITS.stop_max_count)
    raw: bool = False


class OpenAIBody(DecodeFields):
    """Fields shared by the OpenAI-compatible endpoints (plus kvstash's prefix_id, method, budget)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prefix_id: str | None = Field(None, max_length=LIMITS.prefix_id_max_chars)
    max_tokens: MaxNewTokens = LIMITS.max_new_tokens_default
    stop: StopString | Annotated[list[StopString], Field(max_length=LIMITS.stop_max_count)] | None = None


class CompletionBody(OpenAIBody):
    """OpenAI /v1/completions; ``prompt`` is a query with ``prefix_id`` beside it, or JSON {prefix_id, query}."""

    prompt: str = Field(max_length=LIMITS.query_max_chars)


class ChatBody(OpenAIBody):
    """OpenAI /v1/chat/completions; the last user message is the query."""

    messages: list[dict[str, Any]]


PAGE_TIERS = {"gpu": "offload_gpu_hits", "host": "offload_host_pages", "ssd": "offload_ssd_pages"}
"""Metric label of each tier -> the ``GenerationStats.extra`` counter of pages it served."""


class Metrics:
    """Prometheus metrics of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvstash_requests", "HTTP requests", ["route", "status"], registry=self.registry)
        self.prefills = Counter("kvstash_prefills", "Prefills", ["cached"], registry=self.registry)
        self.tokens = Counter("kvstash_generated_tokens", "Generated tokens", registry=self.registry)
        self.latency = Histogram("kvstash_generation_seconds", "Generation wall time", registry=self.registry)
        self.prefix_bytes = Counter("kvstash_prefix_kv_bytes", "Prefix K/V bytes decode steps read (fetched) and "
                                    "would have read with full attention (full)", ["kind"], registry=self.registry)
        self.pages = Counter("kvstash_offload_pages", "Pages the decode steps asked for, by the tier that served "
                             "them", ["tier"], registry=self.registry)

    def observe_generation(self, done: GenerationStats) -> None:
        """Count one finished generation's reads."""
        self.tokens.inc(done.new_tokens)
        self.prefix_bytes.labels("fetched").inc(done.bytes_fetched)
        self.prefix_bytes.labels("full").inc(done.bytes_full)
        for tier, key in PAGE_TIERS.items():
            self.pages.labels(tier).inc(done.extra.get(key, 0.0))


def _grpc_error_response(e: grpc.RpcError) -> JSONResponse:
    status, message, code = relayed_error(e)
    if status >= 500:
        log.warning("upstream error %s: %s", e.code(), e.details())  # the full story for operators only
    retry_after = retry_after_of(e)  # capacity pressure: the worker says when to come back
    return JSONResponse({"error": {"message": message, "code": code}}, status_code=status,
                        headers={"Retry-After": retry_after} if retry_after else None)


class IncompleteAnswer(KVStashError):
    """The worker's stream ended without its closing event."""

    grpc_code = "UNAVAILABLE"
    http_status = 502


HTTP_CODE_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
                   413: "RESOURCE_EXHAUSTED"}
"""gRPC-style code of the HTTP errors Starlette raises itself."""
INCOMPLETE = "the worker's stream ended before the answer was complete"
READY_SERVICES = {"worker": "kvstash.v1.Worker", "store": "kvstash.v1.KVStore"}
"""The dependencies /readyz asks, by the gRPC health service name of each."""


def create_app(cfg: GatewayConfig, keys: ApiKeys, service_token: ServiceToken | None = None) -> FastAPI:
    """The FastAPI application (stubs connect lazily to the worker and the store).

    The worker gets the caller's API key; the store gets ``service_token`` and the tenant the key resolves to.
    """
    app = FastAPI(title="kvstash gateway", version="1")
    worker_ch, store_ch = channel(cfg.worker_addr, cfg.tls), channel(cfg.store_addr, cfg.tls)
    worker, store = pb_grpc.WorkerStub(worker_ch), pb_grpc.KVStoreStub(store_ch)
    metrics = Metrics()

    def md(authorization: str | None, x_api_key: str | None) -> list[tuple[str, str]]:
        key = bearer_key(authorization, x_api_key)
        keys.tenant(key)  # 401 here, before anything is forwarded
        return [(API_KEY_HEADER, key)] if key else []

    def store_md(authorization: str | None, x_api_key: str | None) -> list[tuple[str, str]]:
        return service_metadata(service_token, keys.tenant(bearer_key(authorization, x_api_key)))

    @app.exception_handler(KVStashError)
    def _kv_error(request: Request, e: KVStashError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "code": e.grpc_code}}, status_code=e.http_status)

    @app.exception_handler(grpc.RpcError)
    def _rpc_error(request: Request, e: grpc.RpcError) -> JSONResponse:
        return _grpc_error_response(e)

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (a body that is not even text, an unknown route) in the one error shape.
        code = HTTP_CODE_NAMES.get(e.status_code, "UNKNOWN")
        return JSONResponse({"error": {"message": str(e.detail), "code": code}}, status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        bad_json = any(err.get("type") == "json_invalid" for err in e.errors())
        # Each error without the offending input: it may be huge, or NaN (which a JSON response cannot carry).
        details = [{k: v for k, v in err.items() if k != "input"} for err in e.errors()]
        return JSONResponse({"error": {"message": "malformed JSON body" if bad_json else "invalid request",
                                       "code": "INVALID_ARGUMENT", "details": json.loads(json.dumps(
                                           details, default=str))}}, status_code=400 if bad_json else 422)

    @app.middleware("http")
    async def _limits_and_metrics(request: Request, call_next):  # noqa: ANN001, ANN202
        length = int(request.headers.get("content-length") or 0)
        if length > cfg.max_body_bytes:
            resp: Response = JSONResponse({"error": {"message": f"body over {cfg.max_body_bytes} bytes",
                                                     "code": "RESOURCE_EXHAUSTED"}}, status_code=413)
        else:
            resp = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(resp.status_code)).inc()
        return resp

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    health_stubs = {"worker": health_pb2_grpc.HealthStub(worker_ch), "store": health_pb2_grpc.HealthStub(store_ch)}

    @app.get("/readyz", responses={503: {"description": "A dependency is not serving (named in the body)"}})
    def readyz() -> JSONResponse:
        """Readiness: the worker and the store report SERVING (the store checks its metadata backend)."""
        pending = {name: stub.Check.future(health_pb2.HealthCheckRequest(service=READY_SERVICES[name]),
                                           timeout=cfg.health_timeout_s) for name, stub in health_stubs.items()}
        status = {name: _health_status(f) for name, f in pending.items()}
        ready = all(s == "SERVING" for s in status.values())
        return JSONResponse({"status": "ready" if ready else "not ready", **status}, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/prefixes", status_code=201)
    def prefill(body: PrefillBody, authorization: str | None = Header(None),
                x_api_key: str | None = Header(None)) -> dict[str, Any]:
        meta = md(authorization, x_api_key)
        req = PrefillRequest.from_json(body.model_dump())
        if len(req.document.encode()) > cfg.max_body_bytes:
            raise TooLarge(f"document over {cfg.max_body_bytes} bytes")
        r = worker.Prefill(prefill_chunks(req), metadata=meta, timeout=cfg.request_timeout_s)
        metrics.prefills.labels(str(r.cached).lower()).inc()
        return {"prefix_id": r.prefix_id, "n_tokens": r.n_tokens, "cached": r.cached}

    @app.get("/v1/prefixes")
    def list_prefixes(authorization: str | None = Header(None),
                      x_api_key: str | None = Header(None)) -> dict[str, Any]:
        r = store.ListPrefixes(pb.ListPrefixesRequest(), metadata=store_md(authorization, x_api_key))
        return {"prefixes": [_summary(m) for m in r.prefixes]}

    @app.get("/v1/prefixes/{prefix_id}")
    def get_prefix(prefix_id: str, authorization: str | None = Header(None),
                   x_api_key: str | None = Header(None)) -> dict[str, Any]:
        m = store.GetManifest(pb.PrefixRef(prefix_id=prefix_id), metadata=store_md(authorization, x_api_key))
        full = manifest_from_pb(m)
        return {**_summary(m), "layout": full.layout.to_dict(), "files": [f.__dict__ for f in full.files],
                "artifacts": [a.__dict__ for a in full.artifacts], "manifest_json": m.manifest_json}

    @app.delete("/v1/prefixes/{prefix_id}")
    def delete_prefix(prefix_id: str, authorization: str | None = Header(None),
                      x_api_key: str | None = Header(None)) -> dict[str, Any]:
        store.DeletePrefix(pb.PrefixRef(prefix_id=prefix_id), metadata=store_md(authorization, x_api_key))
        return {"deleted": prefix_id}

    def observed(call: Iterator[pb.GenerateEvent]) -> Iterator[pb.GenerateEvent]:
        t0 = time.perf_counter()
        for ev in call:
            if ev.HasField("done"):
                metrics.observe_generation(stats_from_pb(ev.done))
                metrics.latency.observe(time.perf_counter() - t0)
            yield ev

    async def start(req: GenerateRequest, meta: list[tuple[str, str]],
                    request: Request) -> tuple[Any, Iterator[pb.GenerateEvent]]:
        """The worker call and its events, the first pulled eagerly so errors become HTTP statuses."""
        call = worker.Generate(generate_request_to_pb(req), metadata=meta, timeout=cfg.request_timeout_s)
        events = observed(call)
        first = await run_unless_disconnected(request, call, lambda: next(events, None))
        if first is None:
            raise IncompleteAnswer(INCOMPLETE)
        return call, itertools.chain([first], events)

    @app.post("/v1/prefixes/{prefix_id}/generate", response_model=None)
    async def generate(prefix_id: str, body: GenerateBody, request: Request, authorization: str | None = Header(None),
                       x_api_key: str | None = Header(None)) -> Response | dict[str, Any]:
        meta = md(authorization, x_api_key)
        req = GenerateRequest.from_json(prefix_id, body.model_dump(include=set(GENERATE_JSON_FIELDS)))
        call, events = await start(req, meta, request)
        if body.stream:
            return CancellingStream(_sse(events), call)
        text, stats = await run_unless_disconnected(request, call, lambda: _collect(events))
        return {"prefix_id": prefix_id, "text": text, "stats": stats}

    async def openai(body: OpenAIBody, prompt: str, chat: bool, meta: list[tuple[str, str]],
                     request: Request) -> Response | dict[str, Any]:
        prefix_id, query = _prefix_and_query(body.prefix_id, prompt)
        req = GenerateRequest(prefix_id=prefix_id, query=query, method=body.method,
                              decode=DecodeConfig(budget=body.budget, budget_tokens=body.budget_tokens,
                                                  ratio=body.ratio, gen_len=body.gen_len,
                                                  query_pages=body.query_pages),
                              sampling=SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature,
                                                      top_p=body.top_p, seed=body.seed, stop=_stops(body.stop)))
        call, events = await start(req, meta, request)
        cid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        model = body.model or "kvstash"
        if body.stream:
            return CancellingStream(_openai_stream(events, cid, created, model, chat=chat), call)
        text, stats = await run_unless_disconnected(request, call, lambda: _collect(events))
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(stats)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": _usage(stats)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request, authorization: str | None = Header(None),
                          x_api_key: str | None = Header(None)) -> Response | dict[str, Any]:
        return await openai(body, body.prompt, False, md(authorization, x_api_key), request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody, request: Request, authorization: str | None = Header(None),
                   x_api_key: str | None = Header(None)) -> Response | dict[str, Any]:
        users = [m for m in body.messages if m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise InvalidInput("messages must end with a user message whose content is text")
        return await openai(body, users[-1]["content"], True, md(authorization, x_api_key), request)

    @app.get("/v1/models")
    def models(authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict[str, Any]:
        info = worker.Info(pb.InfoRequest(), metadata=md(authorization, x_api_key))
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "owned_by": "kvstash"}]}

    document_api(app)
    return app


def _health_status(answer: Any) -> str:
    """A dependency's health: SERVING, NOT_SERVING, or the gRPC code when it did not answer."""
    try:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.result().status))
    except grpc.RpcError as e:
        return str(e.code().name)


def _summary(m: pb.Manifest) -> dict[str, Any]:
    return {"prefix_id": m.prefix_id, "n_tokens": m.n_tokens, "model": m.model_name, "kv_bytes": m.kv_bytes,
            "created_at": m.created_at}


def _prefix_and_query(prefix_id: str | None, prompt: str) -> tuple[str, str]:
    if prefix_id:
        return prefix_id, prompt
    try:
        obj = json.loads(prompt)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("prefix_id"), str) and isinstance(obj.get("query"), str):
        return obj["prefix_id"], obj["query"]
    raise InvalidInput('give prefix_id in the body, or a prompt that is JSON {"prefix_id": ..., "query": ...}')


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _collect(events: Iterator[pb.GenerateEvent]) -> tuple[str, dict[str, Any]]:
    parts, stats = [], None
    for ev in events:
        if ev.HasField("done"):
            stats = stats_from_pb(ev.done).to_json()
        else:
            parts.append(ev.text)
    if stats is None:
        raise IncompleteAnswer(INCOMPLETE)
    return "".join(parts), stats


def _stream_error(e: grpc.RpcError | None) -> dict[str, str]:
    """What a stream that broke reports in its last event (None: it ended without its closing event)."""
    if e is None:
        return {"message": INCOMPLETE, "code": IncompleteAnswer.grpc_code}
    _, message, code = relayed_error(e)  # never an internal address
    return {"message": message, "code": code}


def _sse(events: Iterator[pb.GenerateEvent]) -> Iterator[str]:
    """Pieces as ``data:`` events, then ``event: done``; a broken stream ends with ``event: error``."""
    try:
        for ev in events:
            if ev.HasField("done"):
                yield f"event: done\ndata: {json.dumps(stats_from_pb(ev.done).to_json())}\n\n"
                return
            yield f"data: {json.dumps({'text': ev.text, 'step': ev.token.step})}\n\n"
        error = _stream_error(None)
    except grpc.RpcError as e:
        error = _stream_error(e)
    yield f"event: error\ndata: {json.dumps(error)}\n\n"


def _finish(stats: dict[str, Any]) -> str:
    return "length" if stats.get("finish_reason") == "length" else "stop"


def _usage(stats: dict[str, Any]) -> dict[str, int]:
    p, c = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _openai_stream(events: Iterator[pb.GenerateEvent], cid: str, created: int, model: str, chat: bool) -> Iterator[str]:
    """OpenAI chunks, then ``[DONE]``; a broken stream sends an ``{"error": ...}`` chunk before ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    done = False
    try:
        for ev in events:
            if ev.HasField("done"):
                done = True
                finish = _finish(stats_from_pb(ev.done).to_json())
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                          **({"delta": {}} if chat else {"text": ""})}
            else:
                choice = {"index": 0, "finish_reason": None}
                choice.update({"delta": {"content": ev.text}} if chat else {"text": ev.text})
            chunk = {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"
        error = None if done else _stream_error(None)
    except grpc.RpcError as e:
        error = _stream_error(e)
    if error is not None:
        yield f"data: {json.dumps({'error': {**error, 'type': 'server_error'}})}\n\n"
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    """``python -m services.gateway``."""
    import uvicorn

    p = argparse.ArgumentParser(description="kvstash REST gateway")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--worker-addr", default="127.0.0.1:50052")
    p.add_argument("--store-addr", default="127.0.0.1:50051")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--insecure-no-auth", action="store_true",
                   help=f"serve without KVSTASH_API_KEYS (every caller is tenant 'default') and, when "
                        f"{SERVICE_TOKEN_ENV} is unset, call an --insecure store without it: local development only")
    add_tls_args(p)
    args = p.parse_args(argv)
    keys, insecure = ApiKeys.from_env(), insecure_no_auth(args.insecure_no_auth)
    require_api_keys(keys, insecure, "kvstash-gateway")
    token = service_token_or_exit("kvstash-gateway", insecure, "--insecure-no-auth", keys)
    tls = tls_or_exit(args, "kvstash-gateway")
    app = create_app(GatewayConfig(worker_addr=args.worker_addr, store_addr=args.store_addr,
                                   max_body_bytes=args.max_body_bytes, tls=tls), keys, token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
