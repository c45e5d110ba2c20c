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
from lab.train.continued import base_config, card, main, parse_args, variant_config
from lab.train.loop import LOG_FILE, train
from lab.train.run import ship
from workers.ratplus import RatForCausalLM
from workers.ratplus.modeling import MemoryGate

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


def test_cap_ramp_schedule() -> None:
    """Linear from 0 at the stage's start to 1 after `memory_ramp_steps`; without a ramp, 1 throughout."""
    cfg = TrainConfig(model=TINY_MODEL, start_step=10, steps=30, memory_ramp_steps=8)
    assert [cfg.memory_cap_scale(s) for s in (10, 12, 14, 18, 19, 29)] == [0.0, 0.25, 0.5, 1.0, 1.0, 1.0]
    assert all(replace(cfg, memory_ramp_steps=0).memory_cap_scale(s) == 1.0 for s in (10, 14, 29))
    with pytest.raises(ValueError):
        replace(cfg, memory_ramp_steps=-1)


def test_loop_ramps_the_cap_across_a_resume_and_trains_the_gates(plain_export: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`train` sets each step's cap scale from the step alone (a resumed run continues the ramp), the gates
    train while the cap ramps (unlike `memory_hold_steps`), and the saved / exported model has the full cap."""
    torch.set_num_threads(1)
    seen: list[float] = []
    forward = MemoryGate.forward

    def spy(self: MemoryGate, x: torch.Tensor) -> torch.Tensor:
        seen.append(self.cap_scale)
        return forward(self, x)

    monkeypatch.setattr(MemoryGate, "forward", spy)
    tok = AutoTokenizer.from_pretrained(plain_export)
    cfg = TrainConfig(model=replace(TINY_MODEL, memory_max_length=64.0, memory_gate_bias=4.0),
                      curriculum=(Stage(until=1.0, lengths=(128,)),), start_step=1, steps=12, memory_ramp_steps=4,
                      tokens_per_batch=256, workers=0, log_every=1)
    run = tmp_path / "run"
    train(cfg, run, tok, init=plain_export, device="cpu", stop_at=4)  # steps 1-3: scales 0, 1/4, 1/2
    state = ckpt.load_state(run)
    assert state is not None and state["step"] == 4
    assert all(float(state["model"][f"model.layers.{i}.self_attn.memory_gate.weight"].abs().max()) > 0
               for i in range(TINY_MODEL.num_layers))  # W starts at 0: the gates trained during the ramp
    train(cfg, run, tok, init=plain_export, device="cpu", stop_at=7, export_to=tmp_path / "export")  # steps 4-6
    expected = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert seen == [s for s in expected for _ in range(TINY_MODEL.num_layers)]  # each layer's gate, each step
    logged = [json.loads(line)["memory_cap_scale"] for line in (run / LOG_FILE).read_text().splitlines()]
    assert logged == expected
    state = ckpt.load_state(run)
    assert state is not None and state["step"] == 7
    assert not any("cap_scale" in k for k in state["model"])  # no new persistent state: exports load as before
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert all(layer.self_attn.memory_gate.cap_scale == 1.0 for layer in exported.model.layers)


def test_ramp_option_reaches_the_rat_config_and_card(plain_export: Path, tmp_path: Path) -> None:
    """`--memory-ramp-steps` sets the RAT+ run's ramp (the plain baseline has none) and its card says so."""
    args = parse_args(["--out", str(tmp_path), "--max-minutes", "1", "--init", str(plain_export), "--tiny",
                       "--steps", "900", "--memory-ramp-steps", "600"])
    base = base_config(args)
    rat, plain = variant_config(base, "rat"), variant_config(base, "plain")
    assert rat.memory_ramp_steps == 600 and plain.memory_ramp_steps == 0
    assert "cap ramped linearly from 0 (the plain model) to 1 − 1/64 over the first 600 steps" in card(
        "rat", rat, rat.start_step + 1, "cmd", "")
    assert "ramp" not in card("rat", replace(rat, memory_ramp_steps=0), rat.start_step + 1, "cmd", "")
    assert "ramp" not in card("plain", plain, plain.start_step + 1, "cmd", "")


def test_loop_holds_the_mean_gate_up_with_a_floor(plain_export: Path, tmp_path: Path) -> None:
    """With `memory_gate_floor` the loss carries the floor penalty: the gates' biases end higher than in the same
    run without it, and the log reports the penalty and the mean gate (only then)."""
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(plain_export)
    cfg = TrainConfig(model=replace(TINY_MODEL, memory_max_length=64.0, memory_gate_bias=0.0),
                      curriculum=(Stage(until=1.0, lengths=(128,)),), start_step=1, steps=4, tokens_per_batch=256,
                      workers=0, log_every=1, memory_gate_floor=0.9, memory_floor_weight=100.0)
    biases = {}
    for name, c in (("floor", cfg), ("none", replace(cfg, memory_gate_floor=0.0))):
        train(c, tmp_path / name, tok, init=plain_export, device="cpu")
        state = ckpt.load_state(tmp_path / name)
        assert state is not None
        biases[name] = torch.stack([state["model"][f"model.layers.{i}.self_attn.memory_gate.bias"]
                                    for i in range(TINY_MODEL.num_layers)]).mean()
        logged = [json.loads(line) for line in (tmp_path / name / LOG_FILE).read_text().splitlines()]
        has = ["mean_gate" in r and "memory_floor_penalty" in r for r in logged]
        assert all(has) if name == "floor" else not any(has)
    assert float(biases["floor"]) > float(biases["none"]) + 1e-4  # 3 warm-up steps: small, but one way
    with pytest.raises(ValueError):
        replace(cfg, memory_gate_floor=1.0)


def test_floor_option_reaches_the_rat_config_and_card(plain_export: Path, tmp_path: Path) -> None:
    """`--memory-gate-floor` / `--memory-floor-weight` set the RAT+ run's floor (the plain baseline has none)."""
    args = parse_args(["--out", str(tmp_path), "--max-minutes", "1", "--init", str(plain_export), "--tiny",
                       "--steps", "900", "--memory-gate-floor", "0.9", "--memory-floor-weight", "3"])
    base = base_config(args)
    rat, plain = variant_config(base, "rat"), variant_config(base, "plain")
    assert (rat.memory_gate_floor, rat.memory_floor_weight) == (0.9, 3.0) and plain.memory_gate_floor == 0.0
    assert "mean gate held above 0.9 by a penalty of weight 3" in card("rat", rat, rat.start_step + 1, "cmd", "")
    assert "mean gate held" not in card("plain", plain, plain.start_step + 1, "cmd", "")
