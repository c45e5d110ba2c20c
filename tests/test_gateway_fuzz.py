"""Schemathesis against the gateway (in-process ASGI) over a real worker and store: no 5xx, no schema violations.

Each operation gets ``KVSTASH_FUZZ_CASES`` generated cases (default 40: a few hundred in all). The longer
run documented in docs/benchmarks/service.md raises it, e.g. ``KVSTASH_FUZZ_CASES=3000``.
"""

from __future__ import annotations

import itertools
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway import GatewayConfig, create_app
from services.grpc_common import ServerConfig
from services.scheduler import SchedulerConfig
from services.store_server import build_store_server
from services.worker_server import WorkerLimits, build_worker_server
from store.config import StoreConfig
from store.kvstore import KVStore
from tests.conftest import TEST_PAGE_SIZE
from tests.gateway_harness import HEADERS, KEYS, TOKEN
from tests.services_harness import free_port
from workers.engine import Worker
from workers.methods.registry import METHODS
from workers.model import LoadedModel

CASES = int(os.environ.get("KVSTASH_FUZZ_CASES", "40"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
MAX_TOKENS = 8
"""The worker's cap here: aimed cases decode this many tokens at most (a longer ask is a 400)."""
DOC = "A short memo about the vault and the courier. " * 4


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, lm: LoadedModel):
    """A real worker (tiny model, answers capped at 8 tokens) and store server, and the gateway app before them."""
    home = tmp_path_factory.mktemp("fuzz") / "home"
    store = KVStore(StoreConfig(home=home, page_size=TEST_PAGE_SIZE))
    worker = Worker(store, lm, progress=False)
    pid = worker.prefill(DOC, tenant="a").prefix_id
    store_cfg, worker_cfg = ServerConfig(port=free_port()), ServerConfig(port=free_port())
    servers = [build_store_server(store, store_cfg, TOKEN)[0],
               build_worker_server(worker, worker_cfg, KEYS, WorkerLimits(max_new_tokens_cap=MAX_TOKENS),
                                   SchedulerConfig(max_per_tenant=16, max_active=16))[0]]
    for s in servers:
        s.start()
    app = create_app(GatewayConfig(worker_addr=worker_cfg.address, store_addr=store_cfg.address), KEYS, TOKEN)
    yield app, pid
    for s in servers:
        s.stop(0)
    store.close()


@pytest.fixture(scope="module")
def gateway_schema(live):  # noqa: ANN001, ANN201
    return schemathesis.openapi.from_asgi("/openapi.json", live[0])


def _operations() -> list[tuple[str, str]]:
    """(METHOD, path) of every operation the gateway's schema declares."""
    app = create_app(GatewayConfig(worker_addr="127.0.0.1:1", store_addr="127.0.0.1:1"), KEYS)
    return [(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops]


@pytest.mark.parametrize(("method", "path"), _operations(), ids=lambda x: str(x))
def test_gateway_answers_every_generated_request_within_its_schema(gateway_schema, live, method: str,  # noqa: ANN001
                                                                   path: str) -> None:
    pid, turns = live[1], itertools.count()

    def aim(case) -> None:  # noqa: ANN001
        """Every other case: the caller's key, the stored prefix, at most 8 tokens (and some a real method).

        So a share of the generated requests decode for real instead of stopping at 401, 404 or the cap.
        """
        n = next(turns)
        if n % 2:
            return
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in ("authorization",
                                                                                           "x-api-key")}
        case.headers.update(HEADERS["a"])
        if method == "DELETE":  # deleting the one prefix would turn later cases into 404s
            return
        if "prefix_id" in (case.path_parameters or {}):
            case.path_parameters["prefix_id"] = pid
        if isinstance(case.body, dict):
            if "prefix_id" in case.body:
                case.body["prefix_id"] = pid
            for name in ("max_new_tokens", "max_tokens"):
                if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                    case.body[name] = max(1, min(case.body[name], MAX_TOKENS))
            if isinstance(case.body.get("messages"), list) and n % 4 == 0:
                case.body["messages"].append({"role": "user", "content": "q"})
            if "method" in case.body and n % 4 == 0:
                case.body["method"] = sorted(METHODS)[n // 4 % len(METHODS)]

    op = gateway_schema[path][method]
    modes = [op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)]

    @given(case=st.one_of(modes))
    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case) -> None:  # noqa: ANN001
        aim(case)
        statuses.append(case.call_and_validate(headers=HEADERS["a"], checks=CHECKS).status_code)

    statuses: list[int] = []
    check()
    print(method, path, len(statuses), sorted(set(statuses)))
