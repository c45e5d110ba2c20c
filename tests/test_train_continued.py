"""CPU smoke test of the continued training (issue 17): RAT+ and plain from one export, equally long, resumable
after a timeout, exported with cards; the RAT+ export loads through the Auto classes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab.train import checkpoint as ckpt
from lab.train.config import TINY_MODEL, Stage, TrainConfig
from lab.train.continued import main
from lab.train.loop import train
from lab.train.run import ship
from workers.ratplus import RatForCausalLM

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"


@pytest.fixture(scope="module")
def plain_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny plain model trained 1 step and exported with the shipped tokenizer (stands in for kvstash-tiny)."""
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    root = tmp_path_factory.mktemp("init")
    cfg = TrainConfig(model=TINY_MODEL, curriculum=(Stage(until=1.0, lengths=(128,)),), steps=1,
                      tokens_per_batch=256, workers=0, log_every=1)
    train(cfg, root / "run", tok, export_to=root / "export", device="cpu")
    ship(root / "export", MODEL_DIR, tok.eos_token, 128)
    return root / "export"


@pytest.mark.slow
def test_both_variants_train_equally_long_and_resume(plain_export: Path, tmp_path: Path) -> None:
    torch.set_num_threads(2)
    out, models = tmp_path / "cont", tmp_path / "models"
    common = ["--out", str(out), "--steps", "3", "--init", str(plain_export), "--models", str(models), "--tiny"]
    main([*common, "--max-minutes", "0"])  # out of time at once: one step each, both saved and exported
    steps = [json.loads((models / n / ckpt.TRAINER_STATE).read_text())["step"]
             for n in ("kvstash-tiny-rat", "kvstash-tiny-cont")]
    assert steps == [2, 2]  # the init was at step 1
    with pytest.raises(SystemExit):
        main([*common, "--max-minutes", "5"])  # OUT holds runs: --resume needed
    main([*common, "--max-minutes", "5", "--resume"])
    for name in ("kvstash-tiny-rat", "kvstash-tiny-cont"):
        meta = json.loads((models / name / ckpt.TRAINER_STATE).read_text())
        assert meta["step"] == 4 and meta["train_config"]["start_step"] == 1
        card = (models / name / "README.md").read_text()
        assert "lab.train.continued" in card and "steps 1-4" in card
        assert ("memory gates" in card) == (name == "kvstash-tiny-rat")  # the plain model has none
        assert len((models / name / "logs" / "continued.jsonl").read_text().splitlines()) == 3
    rat = AutoModelForCausalLM.from_pretrained(models / "kvstash-tiny-rat")
    plain = AutoModelForCausalLM.from_pretrained(models / "kvstash-tiny-cont")
    assert isinstance(rat, RatForCausalLM) and not isinstance(plain, RatForCausalLM)
    gate = rat.model.layers[0].self_attn.memory_gate
    assert gate.weight.abs().max() > 0  # the gates trained (their weights start at zero)
    rat_cfg = TrainConfig.from_dict(json.loads((models / "kvstash-tiny-rat" / ckpt.TRAINER_STATE).read_text())
                                    ["train_config"])
    plain_cfg = TrainConfig.from_dict(json.loads((models / "kvstash-tiny-cont" / ckpt.TRAINER_STATE).read_text())
                                      ["train_config"])
    assert replace(rat_cfg, model=plain_cfg.model) == plain_cfg  # same run but for the memory module
    assert rat_cfg.model.memory_max_length == 64.0 and plain_cfg.model.memory_max_length is None


@pytest.mark.slow
def test_rat_alone_with_an_open_gate_held_at_its_init(plain_export: Path, tmp_path: Path) -> None:
    torch.set_num_threads(2)
    models = tmp_path / "models"
    common = ["--steps", "3", "--init", str(plain_export), "--models", str(models), "--tiny", "--max-minutes", "5",
              "--variants", "rat", "--memory-gate-bias", "2", "--memory-lr-scale", "1"]
    main(["--out", str(tmp_path / "held"), *common, "--memory-hold-steps", "3"])
    assert not (models / "kvstash-tiny-cont").exists()  # the plain baseline was not asked for
    rat = AutoModelForCausalLM.from_pretrained(models / "kvstash-tiny-rat")
    gate = rat.model.layers[0].self_attn.memory_gate
    assert gate.weight.abs().max() == 0 and torch.all(gate.bias == 2.0)  # held for all three steps
    card = (models / "kvstash-tiny-rat" / "README.md").read_text()
    assert "b = 2 at the start" in card and "held at their init for the first 3 steps" in card
    assert json.loads((models / "kvstash-tiny-rat" / ckpt.TRAINER_STATE).read_text())["step"] == 4

    main(["--out", str(tmp_path / "free"), *common, "--memory-hold-steps", "1"])
    gate = AutoModelForCausalLM.from_pretrained(models / "kvstash-tiny-rat").model.layers[0].self_attn.memory_gate
    assert gate.weight.abs().max() > 0  # released after the first step
