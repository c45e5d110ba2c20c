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


@pytest.mark.slow  # a diagnosis run with every estimator (about 11 s on the VM); make test runs it
def test_value_estimators_run_and_the_true_remainder_is_full_attention(tmp_path: Path) -> None:
    """``--value true@true`` (the true remainder mass and mean) reproduces full attention: zero output error and
    full's answer; every estimator gets answers, per-row errors and a per-layer line; ``--product-index`` answers
    with the product's index remainder and reports its reads."""
    out = tmp_path / "v.json"
    specs = ["true@true", "read", "blk16", "kblk32@kblk", "qv4@idx", "pca4"]
    main(["--model", str(SHIPPED), "--task", "fwe", "--length", "1024", "--samples", "0", "--budget", "0.05",
          "--max-new-tokens", "4", *(x for s in specs for x in ("--value", s)), "--product-index", "index",
          "--output", str(out)])
    d = json.loads(out.read_text())
    (sample,) = d["samples"]
    scored, summary = sample["scored"], d["summary"]["all"]
    assert scored["topk+phi value:true@true"]["text"] == scored["full"]["text"]
    assert summary["err_val[true@true]"] < 1e-5
    for s in specs:
        assert f"topk+phi value:{s}" in scored and math.isfinite(summary[f"err_val[{s}]"])
        assert math.isfinite(summary[f"verr_val[{s}]"])
    assert {line["layer"] for line in d["per_layer"]} == set(range(8))
    reads = sample["reads"]
    assert reads["topk+phi index@index"]["once_bytes"] > reads["topk"]["once_bytes"]  # + the value index
    assert 0 < reads["topk"]["fraction"] < 1


def test_value_specs_parse_and_refuse_nonsense() -> None:
    from lab.phi_diagnose import parse_value

    assert parse_value("blk64@idx") == parse_value("blk64@idx")
    v = parse_value("qv2")
    assert (v.value, v.block, v.mass) == ("qv", 2, "phi")
    for bad in ("blk", "read8", "qv4@nope", "nope"):
        with pytest.raises(ValueError):
            parse_value(bad)
