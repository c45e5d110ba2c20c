"""CPU smoke test: a tiny model trains a few steps from scratch and its loss falls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from workers.synth import SynthContext
from workers.train import checkpoint as ckpt
from workers.train.config import TINY_MODEL, Stage, TrainConfig
from workers.train.data import make_batch
from workers.train.loop import train
from workers.train.objective import build_model, compute_loss

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"


def tiny_config(steps: int) -> TrainConfig:
    return TrainConfig(
        model=TINY_MODEL,
        curriculum=(Stage(until=1.0, lengths=(192,)),),
        steps=steps,
        tokens_per_batch=1152,
        lr=3e-3,
        warmup_steps=3,
        workers=0,
        log_every=1,
        checkpoint_every=1000,
    )


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def held_out_loss(model, cfg: TrainConfig, tok) -> float:
    """Answer + LM loss of a fixed batch the run does not train on."""
    batch = make_batch(cfg, tok, SynthContext(tok, "train"), cfg.steps + 1, 192)
    with torch.no_grad():
        return float(compute_loss(model, batch, cfg.lm_weight).loss)


def test_loss_falls(tok, tmp_path):
    torch.set_num_threads(2)
    cfg = tiny_config(16)
    before = held_out_loss(build_model(cfg.model, tok, cfg.seed), cfg, tok)
    log = train(cfg, tmp_path / "run", tok, device="cpu")
    model = build_model(cfg.model, tok, cfg.seed)
    model.load_state_dict(ckpt.load_state(tmp_path / "run")["model"])
    after = held_out_loss(model, cfg, tok)
    assert len(log) == 16 and after < before - 1.0, (before, after)


def test_resume_and_export(tok, tmp_path):
    cfg = tiny_config(4)
    out, export = tmp_path / "run", tmp_path / "export"
    train(cfg, out, tok, time_budget=0.0, device="cpu")  # stops (and saves) after one step
    assert ckpt.load_state(out)["step"] == 1
    log = train(cfg, out, tok, export_to=export, device="cpu")
    assert [r["step"] for r in log] == [2, 3, 4]
    model, step = ckpt.load_export(export)
    assert step == 4 and model.config.tie_word_embeddings
    shards = list(export.glob("*.safetensors"))
    assert shards and all(s.stat().st_size <= 15_000_000 for s in shards)
