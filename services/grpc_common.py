"""What both gRPC servers share: options, TLS, health, reflection, auth and error mapping."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.auth import API_KEY_HEADER, ApiKeys
from services.convert import HTTP_STATUS_TRAILER
from store.errors import KVStashError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
"""Largest single gRPC message either way: documents stream in chunks, pages in bounded chunks."""
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Network settings of a gRPC server."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_workers: int = 16
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @property
    def address(self) -> str:
        """host:port to bind."""
        return f"{self.host}:{self.port}"


def grpc_options() -> list[tuple[str, int]]:
    """Channel/server options shared by servers and clients."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def build_server(cfg: ServerConfig, service_names: list[str], add_services: Callable[[grpc.Server], None],
                 interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, health.HealthServicer]:
    """A started-ready server with health checking and reflection for ``service_names``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers), options=grpc_options(),
                         interceptors=list(interceptors))
    add_services(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [*service_names, ""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    if cfg.tls_cert and cfg.tls_key:
        creds = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])
        bound = server.add_secure_port(cfg.address, creds)
    else:
        bound = server.add_insecure_port(cfg.address)
    if not bound:
        raise OSError(f"cannot bind {cfg.address}")
    return server, health_servicer


def status_code(err: KVStashError) -> grpc.StatusCode:
    """The gRPC status of a kvstash error (from the one table in store.errors)."""
    return getattr(grpc.StatusCode, err.grpc_code)


def tenant_of(context: grpc.ServicerContext, keys: ApiKeys) -> str:
    """The caller's tenant from its ``x-api-key`` metadata."""
    md = dict(context.invocation_metadata() or ())
    return keys.tenant(md.get(API_KEY_HEADER))


@contextlib.contextmanager
def mapped_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn kvstash errors into gRPC statuses with their message (aborts the RPC)."""
    try:
        yield
    except KVStashError as e:
        context.set_trailing_metadata(((HTTP_STATUS_TRAILER, str(e.http_status)),))  # e.g. 413 vs 429
        context.abort(status_code(e), str(e))
    except ValueError as e:
        context.set_trailing_metadata(((HTTP_STATUS_TRAILER, "400"),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def call_with_errors(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run ``fn`` with kvstash errors mapped to gRPC statuses."""
    with mapped_errors(context):
        return fn()
    raise AssertionError("unreachable: abort raises")


def channel(address: str, tls_ca: Path | None = None) -> grpc.Channel:
    """A client channel with the shared options (TLS when a CA file is given)."""
    if tls_ca:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()), options=grpc_options())
    return grpc.insecure_channel(address, options=grpc_options())


def serve_forever(server: grpc.Server, health_servicer: Any, name: str, address: str) -> None:
    """Start, log, and block until terminated; marks NOT_SERVING on the way out."""
    server.start()
    log.info("%s listening on %s", name, address)
    print(f"{name} listening on {address}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=5).wait()
