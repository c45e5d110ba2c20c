"""Scoring at prefill: ``prefill(doc, compress=[...])`` stores a method's scores right after the prefix, so a
later generation at any ratio only compacts; bad method names are refused at every front door."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from client import KVClient
from services.auth import ApiKeys
from services.gateway import GatewayConfig, create_app
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig
from services.worker_server import WorkerLimits, build_worker_server
from store.errors import InvalidInput
from store.kvstore import KVStore
from tests.services_harness import free_port
from workers.engine import Worker
from workers.methods import hybridkv, kvzip
from workers.methods.compressed import CompressionMethod
from workers.methods.compressed_names import PREFILL_SCORERS
from workers.methods.head_scores import HeadScores
from workers.methods.registry import METHODS
from workers.model import LoadedModel
from workers.requests import LIMITS, DecodeConfig, GenerationStats, SamplingParams

DOC = ("The vault code for the north wing is 4417. The cat sleeps on the warm stones by the river. "
       "Bread is baked before dawn in the old mill. The vault code for the south wing is 9023. ") * 3
KVZIP_SCORES = "kvzip.scores.v1"
REPO = Path(__file__).resolve().parents[1]
BAD_NAMES: list[Any] = [["nope"], ["streamingllm"], ["snapkv"], ["kvzip+quest"], ["x" * 10_000],
                        ["kvzip"] * (LIMITS.compress_max_count + 1)]


@pytest.fixture()
def passes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many reconstruction passes each method ran (the expensive part of scoring)."""
    counts = {"kvzip": 0, "hybridkv": 0}

    def counting(module: Any, name: str) -> None:
        real: Callable[..., Any] = module.reconstruction_scores

        def wrapped(*args: Any, **kw: Any) -> Any:
            counts[name] += 1
            return real(*args, **kw)

        monkeypatch.setattr(module, "reconstruction_scores", wrapped)

    counting(kvzip, "kvzip")
    counting(hybridkv, "hybridkv")
    return counts


def _answer(worker: Worker, pid: str, method: str, ratio: float) -> None:
    "".join(worker.generate(pid, "What is the vault code?", SamplingParams(max_new_tokens=4), method=method,
                            decode=DecodeConfig(ratio=ratio), stats=GenerationStats()))


def test_prefill_with_compress_scores_once_and_generation_only_compacts(worker: Worker, store: KVStore,
                                                                        passes: dict[str, int]) -> None:
    r = worker.prefill(DOC, compress=["kvzip"])
    assert not r.cached and r.manifest.artifact(KVZIP_SCORES) is not None
    assert store.manifest(r.prefix_id).artifact(KVZIP_SCORES) is not None
    assert passes["kvzip"] == 1 and worker.compressions.scorings == 1
    for ratio in (0.3, 0.5):  # any ratio later: a compact cache from the stored scores, no second pass
        _answer(worker, r.prefix_id, "kvzip", ratio)
    _answer(worker, r.prefix_id, "kvzip+quest", 0.2)  # the recall tier reuses its base's scores too
    assert passes["kvzip"] == 1 and worker.compressions.scorings == 1
    assert worker.compressions.builds == 4  # kvzip at 0.3, 0.5, 0.2 and the recall tier's bounds at 0.2


def test_a_cached_prefill_with_compress_adds_the_scores_once(worker: Worker, store: KVStore,
                                                             passes: dict[str, int]) -> None:
    pid = worker.prefill(DOC).prefix_id
    assert store.manifest(pid).artifact(KVZIP_SCORES) is None  # no compress: scored on first use, as before
    again = worker.prefill(DOC, compress=["kvzip", "kvzip"])
    assert again.cached and again.manifest.artifact(KVZIP_SCORES) is not None and passes["kvzip"] == 1
    assert worker.prefill(DOC, compress=["kvzip"]).cached and passes["kvzip"] == 1
    other = Worker(store, worker.lm, progress=False)  # another worker on the store finds them stored
    assert other.prefill(DOC, compress=["kvzip"]).cached and passes["kvzip"] == 1
    assert other.compressions.scorings == 0
    names = [a.name for a in store.manifest(pid).artifacts]
    assert names.count(KVZIP_SCORES) == 1


def test_hybridkv_scores_at_prefill_with_the_models_ranking(store: KVStore, lm: LoadedModel,
                                                            passes: dict[str, int]) -> None:
    lay = lm.layout
    ranking = HeadScores(scores=tuple(tuple(float((layer + h) % 3) for h in range(lay.n_kv_heads))
                                      for layer in range(lay.n_layers)), head_fraction=0.5)
    worker = Worker(store, dataclasses.replace(lm, head_scores=ranking), progress=False)
    r = worker.prefill(DOC, compress=["hybridkv"])
    name = next(a.name for a in r.manifest.artifacts if a.name.startswith("hybridkv.") and ".scores." in a.name)
    assert passes == {"kvzip": 0, "hybridkv": 1}
    _answer(worker, r.prefix_id, "hybridkv", 0.3)
    assert passes["hybridkv"] == 1 and store.manifest(r.prefix_id).artifact(name) is not None


def test_hybridkv_without_a_ranking_is_refused_before_the_forward_pass(worker: Worker, store: KVStore) -> None:
    assert worker.lm.head_scores is None
    with pytest.raises(InvalidInput, match="head ranking"):
        worker.prefill(DOC, compress=["hybridkv"])
    assert store.list_prefixes() == []


def test_the_scoring_phase_is_labelled(store: KVStore, lm: LoadedModel, capsys: pytest.CaptureFixture[str]) -> None:
    Worker(store, lm, progress=True).prefill(DOC, compress=["kvzip"])
    assert "scoring for kvzip" in capsys.readouterr().err


def test_prefill_scorers_are_the_registry_methods_with_their_own_scores() -> None:
    own = {n for n, m in METHODS.items() if issubclass(m, CompressionMethod) and m.scorer is not None}
    assert set(PREFILL_SCORERS) == own


@pytest.mark.parametrize("names", BAD_NAMES, ids=lambda n: str(n)[:20])
def test_the_worker_and_the_embedded_client_refuse_bad_names(worker: Worker, store: KVStore, names: Any,
                                                             tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as e:
        worker.prefill(DOC, compress=names)
    assert len(str(e.value)) < 200 and store.list_prefixes() == []
    kv = KVClient(home=tmp_path / "client-home", model="unused-never-loaded", progress=False)
    with pytest.raises(InvalidInput):  # refused before the model is loaded
        kv.prefill(DOC, compress=names)


@pytest.fixture(scope="module")
def gateway() -> TestClient:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: a body that passes validation fails later as 503
    return TestClient(create_app(GatewayConfig(worker_addr=dead, store_addr=dead), ApiKeys()))


@pytest.mark.parametrize("compress", [*BAD_NAMES, "kvzip", [1], None], ids=lambda n: str(n)[:20])
def test_the_gateway_refuses_bad_names_with_422_and_forwards_good_ones(gateway: TestClient, compress: Any) -> None:
    r = gateway.post("/v1/prefixes", json={"document": "d", "compress": compress})
    assert r.status_code == 422, r.text[:300]
    assert len(r.text) < 2000  # the offending input is not echoed back whole
    r = gateway.post("/v1/prefixes", json={"document": "d", "compress": ["kvzip", "hybridkv"]})
    assert r.status_code == 503, r.text[:300]  # in bounds: forwarded (no worker listens)


@pytest.fixture()
def worker_stub(worker: Worker) -> Iterator[pb_grpc.WorkerStub]:
    cfg = ServerConfig(port=free_port())
    server, _ = build_worker_server(worker, cfg, ApiKeys(), WorkerLimits())
    server.start()
    yield pb_grpc.WorkerStub(grpc.insecure_channel(cfg.address))
    server.stop(0)


def test_grpc_prefill_scores_and_refuses_bad_names(worker_stub: pb_grpc.WorkerStub, store: KVStore,
                                                   passes: dict[str, int]) -> None:
    for names in BAD_NAMES:
        with pytest.raises(grpc.RpcError) as e:
            worker_stub.Prefill(iter([pb.PrefillChunk(text=DOC, compress=names)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 200
    with pytest.raises(grpc.RpcError) as e:  # options ride on the first chunk only
        worker_stub.Prefill(iter([pb.PrefillChunk(text=DOC[:10]), pb.PrefillChunk(text=DOC[10:], compress=["kvzip"])]),
                            timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert store.list_prefixes() == []
    r = worker_stub.Prefill(iter([pb.PrefillChunk(text=DOC[:10], compress=["kvzip"]), pb.PrefillChunk(text=DOC[10:])]),
                            timeout=120)
    assert store.manifest(r.prefix_id).artifact(KVZIP_SCORES) is not None and passes["kvzip"] == 1


def test_the_embedded_client_scores_at_prefill(tmp_path: Path, tiny_model_dir: Path) -> None:
    kv = KVClient(home=tmp_path / "home", model=str(tiny_model_dir), device="cpu", progress=False)
    doc = kv.prefill(DOC, compress=["kvzip"])
    assert kv.info(doc.prefix_id).artifact(KVZIP_SCORES) is not None
    assert kv.worker.compressions.scorings == 1
    kv.generate("What is the vault code?", prefix=doc, method="kvzip", ratio=0.3, max_new_tokens=4)
    assert kv.worker.compressions.scorings == 1 and kv.worker.compressions.builds == 1


def _cli(args: list[str], home: Path, model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSTASH_HOME": str(home), "KVSTASH_MODEL": str(model)}
    return subprocess.run([sys.executable, "-m", "client.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_cli_prefill_takes_compress(tmp_path: Path, tiny_model_dir: Path) -> None:
    home, docfile = tmp_path / "home", tmp_path / "doc.txt"
    docfile.write_text(DOC, encoding="utf-8")
    r = _cli(["prefill", str(docfile), "--compress", "streamingllm"], home, tiny_model_dir)
    assert r.returncode == 2 and "--compress" in r.stderr  # argparse: not one of the choices
    r = _cli(["prefill", str(docfile), "--compress", "kvzip", "--json"], home, tiny_model_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    pid = json.loads(r.stdout)["prefix_id"]
    r = _cli(["info", pid, "--json"], home, tiny_model_dir)
    assert r.returncode == 0 and KVZIP_SCORES in r.stdout, r.stdout[-2000:]
