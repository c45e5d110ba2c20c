"""Remote clients stay light: importing ``client`` and making HTTP or gRPC clients loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_client_import_loads_no_torch_nor_grpc() -> None:
    r = _run("import sys; from client import KVClient; from client.backends import HttpBackend; "
             "assert 'torch' not in sys.modules, 'torch'; assert 'grpc' not in sys.modules, 'grpc'")
    assert r.returncode == 0, r.stderr[-2000:]


def test_remote_clients_load_no_torch() -> None:
    r = _run("import sys; from client import KVClient; "
             "KVClient('http://127.0.0.1:1'); KVClient('grpc://127.0.0.1:1?store=127.0.0.1:2'); "
             "assert 'torch' not in sys.modules; import services.convert; assert 'torch' not in sys.modules")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("module", ["workers.requests", "workers.model_source", "client.config", "store.manifest"])
def test_vocabulary_modules_load_no_torch(module: str) -> None:
    r = _run(f"import sys; import {module}; assert 'torch' not in sys.modules")
    assert r.returncode == 0, r.stderr[-2000:]


def test_embedded_client_still_gets_the_worker(tmp_path: Path, tiny_model_dir: Path) -> None:
    r = _run("import sys; from client import KVClient; "
             f"kv = KVClient(home={str(tmp_path)!r}, model={str(tiny_model_dir)!r}, device='cpu', progress=False); "
             "assert 'torch' not in sys.modules, 'an embedded client loads torch only when its worker is needed'; "
             "n = kv.prefill('Some text to keep. ' * 3).n_tokens; assert 'torch' in sys.modules; print(n)")
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr[-2000:]
