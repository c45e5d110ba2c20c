"""The gateway's /openapi.json: security schemes, every route's error responses, the SSE content type."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.auth import ApiKeys
from services.gateway import GatewayConfig, create_app
from services.openapi_doc import ROUTE_ERRORS, SSE_ROUTES
from tests.services_harness import free_port

ERROR_REF = "#/components/schemas/ErrorBody"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    dead = f"127.0.0.1:{free_port()}"
    app = create_app(GatewayConfig(worker_addr=dead, store_addr=dead), ApiKeys.parse("k:t"))
    return TestClient(app).get("/openapi.json").json()


def _operations(schema: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m, p): op for p, ops in schema["paths"].items() for m, op in ops.items()}


def test_security_schemes_are_declared_and_required_on_every_v1_route(schema: dict[str, Any]) -> None:
    schemes = schema["components"]["securitySchemes"]
    assert schemes["bearerAuth"] == {**schemes["bearerAuth"], "type": "http", "scheme": "bearer"}
    assert schemes["apiKeyAuth"] == {**schemes["apiKeyAuth"], "type": "apiKey", "in": "header", "name": "X-API-Key"}
    for (method, path), op in _operations(schema).items():
        if path.startswith("/v1/"):
            assert op.get("security") == [{"bearerAuth": []}, {"apiKeyAuth": []}], (method, path)
            names = {p["name"].lower() for p in op.get("parameters", [])}
            assert not names & {"authorization", "x-api-key"}, (method, path)
        else:
            assert "security" not in op, (method, path)  # health and metrics stay open


def test_every_v1_route_documents_its_errors(schema: dict[str, Any]) -> None:
    ops = {k: v for k, v in _operations(schema).items() if k[1].startswith("/v1/")}
    assert set(ops) == set(ROUTE_ERRORS), "a /v1 route is missing from services.openapi_doc.ROUTE_ERRORS"
    for key, op in ops.items():
        codes = {int(c) for c in op["responses"] if c[0] in "45"}
        assert codes == set(ROUTE_ERRORS[key]) and {401, 500, 503} <= codes, key
        for code in codes:
            assert op["responses"][str(code)]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
    body = schema["components"]["schemas"]["ErrorBody"]
    assert body["required"] == ["error"] and body["properties"]["error"]["required"] == ["message", "code"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # the gateway's 422 is an ErrorBody too
    assert {400, 413, 422} <= set(ROUTE_ERRORS[("post", "/v1/prefixes")])
    assert 404 in ROUTE_ERRORS[("post", "/v1/prefixes/{prefix_id}/generate")]


def test_streaming_routes_declare_server_sent_events(schema: dict[str, Any]) -> None:
    ops = _operations(schema)
    assert {("post", "/v1/prefixes/{prefix_id}/generate"), ("post", "/v1/completions"),
                          ("post", "/v1/chat/completions")} == SSE_ROUTES
    for key, op in ops.items():
        ok = next((v for c, v in op["responses"].items() if c.startswith("2")), {})
        assert ("text/event-stream" in ok.get("content", {})) == (key in SSE_ROUTES), key


def test_prefill_body_has_no_file_path(schema: dict[str, Any]) -> None:
    body = schema["components"]["schemas"]["PrefillBody"]
    assert set(body["properties"]) == {"document", "compress"} and body["required"] == ["document"]
