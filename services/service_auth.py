"""The store service's gate: every call needs the service token; the tenant rides beside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from services.auth import SERVICE_TOKEN_HEADER, TENANT_HEADER, TENANT_MAX_CHARS, ServiceToken
from store.errors import InvalidInput

REFUSED = "missing or invalid service token"
"""The one answer to every refused call: a tenant's valid API key and garbage get the same words."""


class ServiceTokenInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call to the methods under ``prefix`` without the service token."""

    def __init__(self, token: ServiceToken, prefix: str):
        self.token, self.prefix = token, prefix

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        """The method's handler, or one of the same kind that refuses without reading the request."""
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        presented = [v for k, v in details.invocation_metadata or () if k == SERVICE_TOKEN_HEADER]
        if len(presented) == 1 and self.token.accepts(presented[0]):
            return handler
        return _refusing(handler)


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts; requests stay undeserialized (never parsed for a stranger)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)


def service_tenant(context: grpc.ServicerContext) -> str:
    """The tenant a service call acts for (its ``x-kvstash-tenant`` metadata; the interceptor vouched for it)."""
    values = [v for k, v in context.invocation_metadata() or () if k == TENANT_HEADER]
    if len(values) != 1 or not isinstance(values[0], str) or not 0 < len(values[0]) <= TENANT_MAX_CHARS:
        raise InvalidInput(f"service calls name exactly one tenant in {TENANT_HEADER} metadata "
                           f"(1 to {TENANT_MAX_CHARS} characters)")
    return values[0]
