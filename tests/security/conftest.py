"""Tenant A's data behind every public surface, in process: store and worker gRPC servers, the REST gateway.

Tenant B (and strangers) then attack A through each surface; ``System.assert_a_intact`` checks afterwards
that A's prefix is unchanged and still answers as it did.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from services.auth import ApiKeys, ServiceToken
from services.gateway import GatewayConfig, create_app
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig
from services.store_server import build_store_server
from services.worker_server import build_worker_server
from store.config import StoreConfig
from store.kvstore import KVStore
from tests.services_harness import free_port
from workers.engine import Worker
from workers.model import LoadedModel

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
KEYS = ApiKeys.parse(f"{KEY_A}:tenant-a,{KEY_B}:tenant-b")
TOKEN = ServiceToken("the-service-token-of-this-deployment")
SECRET = "tenant-salt-secret"
DOC_A = "Tenant A's memo. The vault code is 7341. The courier is Odile; she leaves from Lyon at dawn. " * 3
QUERY = " The vault code is"
N_NEW = 6


def bearer(key: str) -> dict[str, str]:
    """REST headers carrying ``key``."""
    return {"Authorization": f"Bearer {key}"}


@dataclass
class System:
    """The running surfaces and tenant A's prefix as it was before any attack."""

    store: KVStore
    gateway: TestClient
    worker: pb_grpc.WorkerStub
    store_stub: pb_grpc.KVStoreStub
    worker_addr: str
    store_addr: str
    pid_a: str
    manifest_json_a: str
    answer_a: str

    def answer(self, key: str = KEY_A) -> str:
        """Tenant A's greedy answer to ``QUERY`` through the gateway."""
        r = self.gateway.post(f"/v1/prefixes/{self.pid_a}/generate", headers=bearer(key),
                              json={"query": QUERY, "max_new_tokens": N_NEW})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    def assert_a_intact(self) -> None:
        """A's prefix: still listed for A, the same manifest, every page and artifact verified, the same answer."""
        listed = self.gateway.get("/v1/prefixes", headers=bearer(KEY_A)).json()["prefixes"]
        assert [p["prefix_id"] for p in listed] == [self.pid_a]
        r = self.gateway.get(f"/v1/prefixes/{self.pid_a}", headers=bearer(KEY_A))
        assert r.status_code == 200 and r.json()["manifest_json"] == self.manifest_json_a
        self.store.verify(self.pid_a)
        assert self.answer() == self.answer_a
        assert [m.prefix_id for m in self.store.list_prefixes()] == [self.pid_a]  # and nothing else was stored


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, lm: LoadedModel) -> Iterator[System]:
    """Store and worker gRPC servers and the gateway over one store, with tenant A's document prefilled."""
    home: Path = tmp_path_factory.mktemp("security") / "home"
    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size))
    worker = Worker(store, lm, secret=SECRET, progress=False)
    store_cfg, worker_cfg = ServerConfig(port=free_port()), ServerConfig(port=free_port())
    store_server, _ = build_store_server(store, store_cfg, TOKEN, SECRET)
    worker_server, _ = build_worker_server(worker, worker_cfg, KEYS)
    store_server.start()
    worker_server.start()
    try:
        gateway = TestClient(create_app(GatewayConfig(worker_addr=worker_cfg.address, store_addr=store_cfg.address),
                                        KEYS, TOKEN))
        r = gateway.post("/v1/prefixes", json={"document": DOC_A}, headers=bearer(KEY_A))
        assert r.status_code == 201, r.text
        pid = r.json()["prefix_id"]
        sut = System(store=store, gateway=gateway, worker=pb_grpc.WorkerStub(grpc.insecure_channel(worker_cfg.address)),
                     store_stub=pb_grpc.KVStoreStub(grpc.insecure_channel(store_cfg.address)),
                     worker_addr=worker_cfg.address, store_addr=store_cfg.address, pid_a=pid,
                     manifest_json_a=store.manifest(pid).to_json(), answer_a="")
        sut.answer_a = sut.answer()
        yield sut
    finally:
        worker_server.stop(0)
        store_server.stop(0)
        store.close()
