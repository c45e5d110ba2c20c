"""`lab.phi_diagnose` on the shipped model at 1k tokens: its rows add up, its fractions are fractions, and a null
correction of φ's logit (shift by 0 nats, cap at 100 %) gives exactly `topk+phi`'s answer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.phi_diagnose import main

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"


def test_phi_diagnose_runs_and_its_null_fixes_change_nothing(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    main(["--model", str(SHIPPED), "--task", "fwe", "--length", "1024", "--samples", "0", "--budget", "0.05",
          "--max-new-tokens", "4", "--fix", "shift:0", "--fix", "cap:1", "--output", str(out)])
    d = json.loads(out.read_text())
    (sample,) = d["samples"]
    scored = sample["scored"]
    assert {"full", "topk", "topk+phi", "topk+phi shift:0", "topk+phi cap:1"} <= set(scored)
    assert scored["topk+phi shift:0"]["text"] == scored["topk+phi"]["text"]
    assert scored["topk+phi cap:1"]["text"] == scored["topk+phi"]["text"]
    summary = d["summary"]
    assert summary["all"]["rows"] == sum(summary[b]["rows"] for b in ("diffuse", "mixed", "peaked")) > 0
    for b in ("all", "diffuse", "mixed", "peaked"):
        if summary[b]["rows"]:
            assert 0.0 <= summary[b]["pR"] <= 1.0 and 0.0 <= summary[b]["pR_est"] <= 1.0
            errors = ("err_exact", "err_phi", "err_true_mass", "err_true_value")
            assert all(math.isfinite(summary[b][k]) for k in errors)
    assert summary["all"]["err_fix"] == pytest.approx(summary["all"]["err_phi"], rel=1e-6)  # the first fix: null
