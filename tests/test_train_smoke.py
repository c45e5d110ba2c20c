"""CPU smoke test: a tiny model trains a few steps from scratch and its loss falls; fine-tune stages."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lab.synth import SynthContext
from lab.train import checkpoint as ckpt
from lab.train.config import PRESETS, TINY_MODEL, AggregationMix, MixConfig, Stage, TrainConfig
from lab.train.data import batch_length, make_batch
from lab.train.encode import AGGREGATE, ANSWER, collate, encode
from lab.train.loop import lr_at, train
from lab.train.mix import episode
from lab.train.objective import build_model, compute_loss

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


@pytest.mark.slow
def test_loss_falls(tok, tmp_path):
    torch.set_num_threads(2)
    cfg = tiny_config(16)
    before = held_out_loss(build_model(cfg.model, tok, cfg.seed), cfg, tok)
    log = train(cfg, tmp_path / "run", tok, device="cpu")
    model = build_model(cfg.model, tok, cfg.seed)
    model.load_state_dict(ckpt.load_state(tmp_path / "run")["model"])
    after = held_out_loss(model, cfg, tok)
    assert len(log) == 16 and after < before - 1.0, (before, after)


@pytest.mark.slow
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


def test_finetune_stage_starts_at_the_exported_step(tok, tmp_path):
    base, export, ft = tiny_config(2), tmp_path / "base_export", tmp_path / "ft"
    train(base, tmp_path / "base", tok, export_to=export, device="cpu")
    stage = replace(tiny_config(3), start_step=ckpt.export_step(export), steps=5, agg_weight=1.0)
    assert lr_at(stage, 2) < lr_at(stage, 3) and batch_length(stage, 2) == 192  # own warm-up
    log = train(stage, ft, tok, init=export, export_to=tmp_path / "ft_export", device="cpu")
    assert [r["step"] for r in log] == [3, 4, 5] and all("agg_loss" in r for r in log)
    meta = json.loads((tmp_path / "ft_export" / ckpt.TRAINER_STATE).read_text())
    assert meta["step"] == 5 and meta["train_config"]["start_step"] == 2
    assert [h["step"] for h in meta["history"]] == [2]
    assert TrainConfig.from_dict(meta["train_config"]) == stage
    assert TrainConfig.from_dict(meta["history"][0]["train_config"]) == base


def test_aggregation_answers_get_their_own_loss_term(tok):
    cfg = tiny_config(1)
    ctx = SynthContext(tok, "train")
    only = dict.fromkeys(("dense_recall", "ruler", "repeat", "plain_text", "aggregation"), 0.0)
    agg, dense = MixConfig(**{**only, "aggregation": 1.0}), MixConfig(**{**only, "dense_recall": 1.0})
    episodes = [episode(ctx, agg, 192, s) for s in range(3)] + [episode(ctx, dense, 192, 0)]
    assert [e.aggregation for e in episodes] == [True, True, True, False]
    items = [encode(tok, e) for e in episodes]
    batch = {k: torch.from_numpy(v) for k, v in collate(items, 192, tok.pad_token_id).items()}
    assert (batch["kinds"] == AGGREGATE).any() and (batch["kinds"] == ANSWER).any()
    model = build_model(cfg.model, tok, cfg.seed)
    with torch.no_grad():
        pooled, apart = compute_loss(model, batch, 0.3), compute_loss(model, batch, 0.3, agg_weight=2.0)
    assert float(apart.agg_loss) > 0 and float(pooled.agg_loss) == float(apart.agg_loss)
    torch.testing.assert_close(apart.loss, apart.answer_loss + 0.3 * apart.lm_loss + 2.0 * apart.agg_loss)
    assert not torch.isclose(pooled.answer_loss, apart.answer_loss)  # pooled: agg tokens are answers


def test_default_mix_has_no_aggregation_rows_and_presets_validate():
    assert MixConfig().aggregation == 0.0 and PRESETS["base"] == TrainConfig()
    ft = PRESETS["aggregation"]
    assert ft.mix.aggregation > 0 and ft.agg_weight is not None and 1 in ft.mix.agg.cwe_common
    cmp = PRESETS["compare"]
    assert cmp.mix.agg.compare_share == 0.5 and cmp.agg_weight is not None
    assert replace(cmp.mix, agg=replace(cmp.mix.agg, compare_share=0.0)) == ft.mix  # stage 2's mix otherwise
    assert MixConfig.from_dict(json.loads(json.dumps(cmp.to_dict()))["mix"]) == cmp.mix
    with pytest.raises(ValueError):
        AggregationMix(cwe_common=())
    with pytest.raises(ValueError):
        AggregationMix(compare_share=1.5)
    with pytest.raises(ValueError):
        TrainConfig(start_step=10, steps=10)


def test_compare_share_draws_compare_rows_flagged_as_aggregation(tok):
    ctx = SynthContext(tok, "train")
    only = dict.fromkeys(("dense_recall", "ruler", "repeat", "plain_text"), 0.0)
    mix = MixConfig(**only, aggregation=1.0, agg=AggregationMix(compare_share=1.0))
    for seed in range(3):
        ep = episode(ctx, mix, 512, seed)
        (query, target), = ep.turns
        assert ep.aggregation and "Which word occurs more often" in query
        assert target.strip() in query and ep.document.count(target.strip()) > 1

