"""`lab.memory_gates`: per-layer statistics of a RAT+ model's gates, checked against the gates computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import workers.ratplus  # noqa: F401 - registers the RAT+ model type
from lab.memory_gates import gate_stats, main
from lab.tiny_random import TinyLlamaSpec, build_tiny_llama, build_tiny_rat


def test_gate_stats_match_the_gates_computed_by_hand(tmp_path: Path) -> None:
    path = build_tiny_rat(tmp_path / "rat", TinyLlamaSpec(seed=0))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(0))
    rows = gate_stats(model, ids)
    layers = model.model.layers
    assert [r["layer"] for r in rows] == list(range(len(layers)))
    with torch.no_grad():  # layer 0's gates: its input is the embedding after the first RMSNorm
        x = layers[0].input_layernorm(model.model.embed_tokens(ids))
        g0 = layers[0].self_attn.memory_gate(x).float().flatten()
    assert rows[0]["mean"] == pytest.approx(float(g0.mean()), rel=1e-5)
    assert rows[0]["median"] == pytest.approx(float(g0.median()), rel=1e-5)
    assert rows[0]["effective_length"] == pytest.approx(1 / (1 - float(g0.mean())), rel=1e-5)
    assert all(0 < r["mean"] < 1 and r["median"] <= r["p99"] for r in rows)
    assert len({round(r["mean"], 6) for r in rows}) > 1  # each layer its own gates


def test_a_plain_model_has_no_gates(tmp_path: Path) -> None:
    path = build_tiny_llama(tmp_path / "plain", TinyLlamaSpec(seed=0))
    with pytest.raises(SystemExit, match="no memory gates"):
        main([str(path), "--tokens", "32"])
