"""The benchmarks' CPU smoke runs still work (they are run for real on the GPU; here only the plumbing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_offload.py", "bench_worker_decode.py", "bench_fairness.py",
                                    "bench_engine.py", "bench_cpu_decode.py", "bench_open.py",
                                    "bench_query_time_ttft.py"])
def test_bench_quick_run(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # faulthandler: a crash of the bench prints every thread's stack into the failure message
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", "--json", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    assert out.stat().st_size > 0 and "|" in r.stdout  # a results table was printed and saved
