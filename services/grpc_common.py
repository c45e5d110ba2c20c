"""What both gRPC servers share: options, mutual TLS, health, reflection, auth and error mapping."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.auth import API_KEY_HEADER, ApiKeys
from services.convert import HTTP_STATUS_TRAILER, RETRY_AFTER_TRAILER
from services.tls import TlsConfig
from store.errors import KVStashError, Overloaded

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
"""Largest single gRPC message either way: documents stream in chunks, pages in bounded chunks."""
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
"""A client reconnects to a restarted server within about a second (gRPC's default backoff grows to 120 s)."""
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Network settings of a gRPC server."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_workers: int = 16
    tls: TlsConfig | None = None
    """Mutual TLS (clients must present a certificate from its CA); None: a plaintext port."""
    drain_s: float = 10.0
    """On SIGTERM: seconds in-flight calls get to finish before they are cancelled."""

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
    if cfg.tls is not None:
        bound = server.add_secure_port(cfg.address, cfg.tls.server_credentials())
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
        trailers = [(HTTP_STATUS_TRAILER, str(e.http_status))]  # e.g. 413 vs 429
        if isinstance(e, Overloaded):
            trailers.append((RETRY_AFTER_TRAILER, str(e.retry_after_s)))
        context.set_trailing_metadata(tuple(trailers))
        context.abort(status_code(e), str(e))
    except ValueError as e:
        context.set_trailing_metadata(((HTTP_STATUS_TRAILER, "400"),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def call_with_errors(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run ``fn`` with kvstash errors mapped to gRPC statuses."""
    with mapped_errors(context):
        return fn()
    raise AssertionError("unreachable: abort raises")


def channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A client channel with the shared options and a short reconnect backoff (mutual TLS when ``tls`` is set)."""
    options = grpc_options() + RECONNECT_OPTIONS
    if tls is not None:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)


def watch_health(health_servicer: Any, service_names: list[str], probe: Callable[[], object],
                 interval_s: float = 1.0) -> threading.Thread:
    """Mark ``service_names`` NOT_SERVING while ``probe`` raises, SERVING again once it passes."""
    def loop() -> None:
        serving = True
        while True:
            try:
                probe()
                ok = True
            except Exception as e:  # any failure of a dependency means not ready; the thread must live on
                ok = False
                if serving:
                    log.warning("not serving: %s: %s", type(e).__name__, e)
            if ok != serving:
                status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in [*service_names, ""]:
                    health_servicer.set(name, status)
                serving = ok
            threading.Event().wait(interval_s)

    thread = threading.Thread(target=loop, name="health-probe", daemon=True)
    thread.start()
    return thread


def serve_forever(server: grpc.Server, health_servicer: Any, name: str, address: str, drain_s: float = 10.0,
                  close: Callable[[], None] | None = None) -> NoReturn:
    """Start, log, and serve until SIGTERM or SIGINT; then NOT_SERVING, no new calls, drain in-flight ones,
    ``close`` what the service holds, and exit 0."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())
    server.start()
    log.info("%s listening on %s", name, address)
    print(f"{name} listening on {address}", flush=True)
    stopping.wait()
    print(f"{name} draining (up to {drain_s:g} s)", flush=True)
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=drain_s).wait()
    if close is not None:
        close()
    print(f"{name} stopped", flush=True)
    logging.shutdown()
    # Everything is drained and closed: skip interpreter finalization, where native threads still parked in
    # gRPC's and torch's pools can abort the process ("terminate called without an active exception",
    # seen in about one SIGTERM in four), which would turn a clean drain into exit status 134.
    os._exit(0)
