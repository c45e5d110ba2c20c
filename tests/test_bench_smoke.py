"""The benchmarks' CPU smoke runs still work (they are run for real on the GPU; here only the plumbing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_offload.py", "bench_worker_decode.py", "bench_fairness.py",
                                    "bench_engine.py", "bench_cpu_decode.py", "bench_open.py",
                                    "bench_query_time_ttft.py", "bench_prefill.py",
                                    "bench_kmeans_assign.py", "bench_kmeans_seeding.py", "bench_capacity.py",
                                    "bench_model_ops.py", "bench_sampling.py", "bench_summaries.py"])
def test_bench_quick_run(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # faulthandler: a crash of the bench prints every thread's stack into the failure message
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", "--json", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    assert out.stat().st_size > 0 and "|" in r.stdout  # a results table was printed and saved


def _quick(script: str, tmp_path: Path) -> tuple[str, dict]:
    """Run a bench's ``--quick`` CPU smoke run; (stdout, its --json)."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", "--json", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    assert "|" in r.stdout  # a results table was printed
    return r.stdout, json.loads(out.read_text())


def test_compress_time_quick_scores_through_prefill(tmp_path: Path) -> None:
    """Each scored row ran its scoring pass inside the prefill (the prefix was removed first, so nothing was found
    stored); the prefill alone ran none."""
    stdout, res = _quick("bench_compress_time.py", tmp_path)
    assert res["device"] == "cpu" and res["dtype"] == "float32" and "hybridkv / kvzip" in stdout
    (r,) = res["rounds"]
    assert r["prefill"][1] == 0.0 and r["kvzip"][1] > 0 and r["hybridkv"][1] > 0
    assert res["summary"]["kvzip_score_s"] > 0 and res["summary"]["forward only_s"] > 0


def test_ratplus_cost_quick_compares_both_models(tmp_path: Path) -> None:
    """Both models ran the same document; every cost is positive and finite."""
    stdout, res = _quick("bench_ratplus_cost.py", tmp_path)
    assert res["random_weights"] is True and "random weights" in stdout
    (r,) = res["results"].values()
    assert r["plain"]["n_tokens"] == r["rat+"]["n_tokens"] > 0
    for m in ("plain", "rat+"):
        assert all(math.isfinite(v) and v > 0 for v in r[m].values())


def test_scratch_dir_is_removed_when_the_bench_is_terminated(tmp_path: Path) -> None:
    """``timeout`` stops a bench with SIGTERM: its scratch dir (a store of tens of GB at 128k) must not be left on
    the disk for the next run."""
    import signal
    import time

    marker = tmp_path / "scratch"
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            "from bench.common import in_scratch_dir\n"
            "def fn(work):\n"
            "    (work / 'pages').write_bytes(b'x' * 4096)\n"
            f"    open({str(marker)!r}, 'w').write(str(work))\n"
            "    time.sleep(60)\n"
            "in_scratch_dir(fn)\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    work = Path(marker.read_text())
    assert work.is_dir()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert not work.exists()
