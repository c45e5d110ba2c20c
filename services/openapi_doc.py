"""What the gateway's OpenAPI schema says beyond the routes: security schemes, error responses, SSE."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

ERROR_BODY = {
    "title": "ErrorBody",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "code"],
        "properties": {
            "message": {"type": "string", "description": "Short; never echoes the input or internal addresses."},
            "code": {"type": "string", "description": "gRPC-style code, e.g. NOT_FOUND, INVALID_ARGUMENT."},
            "details": {"type": "array", "items": {"type": "object"}, "description": "Schema errors (422)."},
        },
    }},
}
SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"},
    "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
}
ERROR_DESCRIPTIONS = {
    400: "Malformed JSON, or a value out of range",
    401: "Missing or invalid API key",
    404: "No such prefix (another tenant's prefix is a 404 too)",
    409: "The prefix was stored by another model, or a concurrent operation holds it",
    413: "Body, document or context too large",
    422: "The body does not match the schema",
    429: "Over the tenant's quota, or too many requests",
    500: "Internal error",
    503: "An upstream service is unavailable",
    504: "The request timed out upstream",
}
_COMMON = (401, 500, 503)
_BODY = (400, 413, 422)
_GENERATE = (*_COMMON, *_BODY, 404, 409, 429, 504)
ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/prefixes"): (*_COMMON, *_BODY, 429, 504),
    ("get", "/v1/prefixes"): _COMMON,
    ("get", "/v1/prefixes/{prefix_id}"): (*_COMMON, 400, 404),
    ("delete", "/v1/prefixes/{prefix_id}"): (*_COMMON, 400, 404, 409),
    ("post", "/v1/prefixes/{prefix_id}/generate"): _GENERATE,
    ("post", "/v1/completions"): _GENERATE,
    ("post", "/v1/chat/completions"): _GENERATE,
    ("get", "/v1/models"): _COMMON,
}
"""The error statuses each authenticated route can answer (a test checks every /v1 route is here)."""
SSE_ROUTES = {("post", "/v1/prefixes/{prefix_id}/generate"), ("post", "/v1/completions"),
              ("post", "/v1/chat/completions")}
"""Routes that answer ``text/event-stream`` when the body sets ``"stream": true``."""
SSE_EVENT = {
    "title": "ServerSentEvent",
    "description": "One event of the stream: `data:` pieces, then `event: done` (or `data: [DONE]` on the OpenAI "
                   "routes); a stream that breaks ends with `event: error` (OpenAI: an `error` chunk, then [DONE]).",
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string", "enum": ["message", "done", "error"]}, "data": {"type": "string"}},
}
"""What a client parses from the SSE routes, one event at a time (a schema per event, as SSE tools read it)."""
_AUTH_HEADERS = {"authorization", "x-api-key"}


def document_api(app: FastAPI) -> None:
    """Make ``app.openapi()`` declare the security schemes, every route's errors and the SSE content type."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = annotate(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def annotate(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with security, error responses (one ErrorBody schema) and SSE content added to /v1 routes."""
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["ErrorBody"] = ERROR_BODY
    components["securitySchemes"] = SECURITY_SCHEMES
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            if (method, path) in ROUTE_ERRORS:
                _annotate_operation(op, ROUTE_ERRORS[(method, path)], (method, path) in SSE_ROUTES)
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, which the gateway never sends
        if f"#/components/schemas/{name}" not in json.dumps(schema):
            components["schemas"].pop(name, None)
    return schema


def _annotate_operation(op: dict[str, Any], errors: tuple[int, ...], sse: bool) -> None:
    # The key headers are described by the security schemes, not as parameters.
    op["parameters"] = [p for p in op.get("parameters", []) if p.get("name", "").lower() not in _AUTH_HEADERS]
    if not op["parameters"]:
        del op["parameters"]
    op["security"] = [{"bearerAuth": []}, {"apiKeyAuth": []}]
    # Only the statuses the route can answer (FastAPI lists a 422 wherever a route has parameters).
    responses = {k: v for k, v in op.get("responses", {}).items() if k[0] not in "45"}
    op["responses"] = responses
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for status in sorted(set(errors)):
        responses[str(status)] = {"description": ERROR_DESCRIPTIONS[status],
                                  "content": {"application/json": {"schema": ref}}}
    if sse:
        ok = next(v for k, v in responses.items() if k.startswith("2"))
        ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
        ok["description"] = "The answer as JSON, or as Server-Sent Events when the body sets stream: true"
