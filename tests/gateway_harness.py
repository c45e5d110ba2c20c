"""Store, worker and gateway servers in this process (gateway on a real uvicorn), for tests that need a socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from services.auth import ApiKeys, ServiceToken
from services.gateway import GatewayConfig, create_app
from services.grpc_common import ServerConfig
from services.scheduler import SchedulerConfig
from services.store_server import build_store_server
from services.worker_server import WorkerLimits, build_worker_server
from tests.services_harness import free_port
from workers.engine import Worker

KEYS = ApiKeys({"key-a": "a", "key-b": "b"})
TOKEN = ServiceToken("gateway-harness-service-token")
"""What the gateway presents to the store (a service credential, no tenant's key)."""
HEADERS = {"a": {"Authorization": "Bearer key-a"}, "b": {"Authorization": "Bearer key-b"}}


@dataclass
class Services:
    """Running servers and where they listen."""

    url: str
    worker_addr: str
    store_addr: str
    worker_server: grpc.Server
    store_server: grpc.Server
    store_health: Any


@contextmanager
def serve_http(app: Any) -> Iterator[str]:
    """``app`` on uvicorn in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def services(worker: Worker, scheduling: SchedulerConfig | None = None,
             limits: WorkerLimits | None = None) -> Iterator[Services]:
    """A store server and a worker server over ``worker`` (sharing its store), and a gateway in front."""
    store_cfg, worker_cfg = ServerConfig(port=free_port()), ServerConfig(port=free_port())
    store_server, store_health = build_store_server(worker.store, store_cfg, TOKEN)
    worker_server, _ = build_worker_server(worker, worker_cfg, KEYS, limits, scheduling)
    store_server.start()
    worker_server.start()
    app = create_app(GatewayConfig(worker_addr=worker_cfg.address, store_addr=store_cfg.address), KEYS, TOKEN)
    try:
        with serve_http(app) as url:
            yield Services(url, worker_cfg.address, store_cfg.address, worker_server, store_server, store_health)
    finally:
        worker_server.stop(0)
        store_server.stop(0)
