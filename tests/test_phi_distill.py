"""Distilled φ feature maps: the appendix-B loss, training, shipping and use by the worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from lab.train.phi_distill import (
    CAPTURE_ATTN,
    DistillConfig,
    DistillLoss,
    capture,
    distill_loss,
    log_z_error,
    model_shape,
    save_map,
    student_logits,
    train_map,
    value_error,
)
from store.artifacts import bytes_to_tensors
from workers.methods.memory import MemorySource
from workers.methods.phi import PhiCompletion, PhiSummarizer
from workers.methods.phi_maps import MAP_CONFIG, FavorFeatureMap, ReZeroMLPFeatureMap, load_feature_map
from workers.methods.registry import get_method

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"
SHAPE = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8}


def test_loss_is_zero_for_a_perfect_student_and_penalizes_overestimated_mass():
    s = torch.randn(3, 50) * 4
    parts = distill_loss(s, s.clone(), DistillLoss(lambda_residual=1.0, residual_top=8))
    assert all(float(v) == pytest.approx(0.0, abs=1e-6) for v in parts.values())
    over = distill_loss(s, s + 1.0, DistillLoss())  # same shape, e times the mass
    assert float(over["kl"]) == pytest.approx(0.0, abs=1e-5)  # the KL term is blind to a shift ...
    assert float(over["z"]) > 0.4 and float(over["top"]) > 0.4  # ... the auxiliary terms are not
    under = distill_loss(s, s - 1.0, DistillLoss())
    assert float(under["z"]) == 0.0  # log-partition penalty is one-sided (overestimation only)
    tail = s.clone()
    tail[s < s.topk(8, -1).values[..., -1:]] += 2.0  # only keys outside each row's top 8 overestimated
    res = distill_loss(s, tail, DistillLoss(lambda_residual=1.0, residual_top=8))
    assert float(res["residual"]) == pytest.approx(1.5, abs=1e-4)  # huber(2) with delta 1


def test_student_logits_are_the_log_feature_inner_products():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 5, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    for fmap in (FavorFeatureMap(16), ReZeroMLPFeatureMap(phi_dim=16, seed=1, **SHAPE)):
        got = student_logits(fmap, 1, q, k, 0.35)
        lq = fmap.log_phi_q(1, q.reshape(2, 2, 5, 8).permute(2, 0, 1, 3), 0.35).permute(1, 2, 0, 3).reshape(4, 5, 16)
        lk = fmap.log_phi_k(1, k).repeat_interleave(2, 0)
        want = torch.logsumexp(lq[:, :, None, :] + lk[:, None, :, :], -1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def teacher():
    model = LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation=CAPTURE_ATTN)
    return model.eval(), AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.mark.slow
def test_distillation_on_the_shipped_model_beats_favor_and_ships(teacher, tmp_path):
    model, tok = teacher
    train = capture(model, tok, "train", 4, (384,), seed=0)
    held = capture(model, tok, "eval", 2, (384,), seed=1)
    assert len(train[0].q) == model.config.num_hidden_layers and train[0].q[0].shape[0] == 8
    cfg = DistillConfig(phi_dim=8, hidden=16, steps=60, lr=1e-2, loss=DistillLoss(lambda_kl=0.5))
    shape = model_shape(model.config)
    untrained = log_z_error(ReZeroMLPFeatureMap(phi_dim=8, hidden=16, seed=0, **shape), held, drop_top=16)
    favor = log_z_error(FavorFeatureMap(shape["head_dim"]), held, drop_top=16)
    fmap, log = train_map(train, held, cfg, shape, "cpu")
    final = log[-1]["heldout_residual_log_z_err"]
    assert final < 0.5 * untrained and final < 0.25 * favor, (final, untrained, favor)  # FAVOR+: many nats off
    save_map(fmap, tmp_path, cfg, shape, {"log": log})
    loaded = load_feature_map(tmp_path)
    assert loaded is not None and loaded.seed == json.loads((tmp_path / MAP_CONFIG).read_text())["digest"] != 0
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(loaded.log_phi_k(3, x), fmap.log_phi_k(3, x))
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no leftovers
    assert load_feature_map(tmp_path / "missing") is None


def test_a_cache_built_with_one_map_is_refused_with_another():
    a = ReZeroMLPFeatureMap(phi_dim=8, seed=0, **SHAPE)
    b = ReZeroMLPFeatureMap(phi_dim=8, seed=0, **SHAPE)
    a.digest, b.digest = 11, 12

    class WithA(PhiSummarizer):
        def __init__(self) -> None:
            super().__init__(a)

    g = torch.Generator().manual_seed(3)
    kv = [(torch.randn(2, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g)) for _ in range(2)]
    src = MemorySource.build(kv, [WithA])
    assert int(src.artifact("phi")["0.meta"][2]) == 11
    PhiCompletion(src, a)  # the same map opens it
    with pytest.raises(ValueError, match="does not match"):
        PhiCompletion(src, b)
    with pytest.raises(ValueError, match="rezero_mlp"):
        PhiCompletion(src, None)  # FAVOR+ cannot read a learned map's cache
    assert get_method("topk+phi", a).feature_map is a and get_method("topk", a).feature_map is None


def test_the_worker_uses_a_shipped_map(tmp_path):
    from client import KVClient

    model_dir = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model_dir, ignore=shutil.ignore_patterns("logs"))
    shipped = load_feature_map(MODEL_DIR)
    assert shipped is not None, "the shipped model carries its distilled map"
    kv = KVClient(home=tmp_path / "home", model=str(model_dir), device="cpu", progress=False)
    with_map = kv.worker.lm
    assert with_map.phi_map is not None and with_map.phi_map.seed == shipped.seed
    doc = kv.prefill("The special magic number for amber-lantern is: 4921873. " + "Nothing else happened. " * 60)
    out = kv.generate("What is the special magic number for amber-lantern mentioned in the provided text?",
                      prefix=doc, method="topk+phi", budget=0.2, max_new_tokens=12)
    assert "4921873" in out.text
    art = kv.worker.store.artifact(doc.prefix_id, "phi")  # built by that generation (late, on use on the CPU)
    meta = bytes_to_tensors(art)["0.meta"]
    assert int(meta[0]) == ReZeroMLPFeatureMap.kind and int(meta[2]) == shipped.seed
    for name in ("phi_map.json", "phi_map.safetensors"):
        (model_dir / name).unlink()
    plain = KVClient(home=tmp_path / "home2", model=str(model_dir), device="cpu", progress=False).worker.lm
    assert plain.phi_map is None and plain.fingerprint != with_map.fingerprint  # caches never mix


def test_a_map_for_another_model_shape_is_refused_at_load(tmp_path):
    from workers.model import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model_dir, ignore=shutil.ignore_patterns("logs", "phi_map.*"))
    cfg = DistillConfig(phi_dim=4, hidden=8)
    save_map(ReZeroMLPFeatureMap(phi_dim=4, hidden=8, **SHAPE), model_dir, cfg, SHAPE, {})
    with pytest.raises(ValueError, match="phi_map is for"):
        load_model(str(model_dir), progress=False)


def test_value_term_is_off_by_default_zero_for_a_perfect_student_and_sees_a_wrong_remainder_mean():
    g = torch.Generator().manual_seed(0)
    s, v = torch.randn(2, 3, 50, generator=g) * 4, torch.randn(2, 50, 6, generator=g)
    c = DistillLoss(lambda_value=1.0, residual_top=8)
    assert float(distill_loss(s, s.clone(), c, v)["value"]) == pytest.approx(0.0, abs=1e-6)
    off = distill_loss(s, s + torch.randn(s.shape, generator=g), DistillLoss(), v)
    assert float(off["value"]) == 0.0  # the shipped recipe is unchanged
    shifted = s + 3.0  # same remainder distribution: the mean value is blind to a uniform shift
    assert float(distill_loss(s, shifted, c, v)["value"]) == pytest.approx(0.0, abs=1e-5)
    wrong = distill_loss(s, s + 2 * torch.randn(s.shape, generator=g), c, v)
    assert float(wrong["value"]) > 0.05
    # the term's own definition: the relative squared error of the mean over the keys outside the top 8
    idx = s.topk(8, -1).indices
    want = torch.softmax(s.scatter(-1, idx, float("-inf")), -1) @ v
    got = torch.softmax((s + 1.0).scatter(-1, idx, float("-inf")), -1) @ v
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        distill_loss(s, s, c)  # values are required when the term is on


@pytest.mark.slow
def test_value_aware_distillation_captures_values_and_lowers_the_remainder_mean_error(teacher):
    model, tok = teacher
    train = capture(model, tok, "train", 4, (384,), seed=0, values=True)
    held = capture(model, tok, "eval", 2, (384,), seed=1, values=True)
    assert train[0].v is not None and train[0].v[0].shape == train[0].k[0].shape
    assert capture(model, tok, "eval", 1, (384,), seed=1)[0].v is None  # off by default
    shape = model_shape(model.config)
    loss = DistillLoss(lambda_kl=0.5, lambda_residual=2.0, lambda_value=4.0, residual_top=8)
    cfg = DistillConfig(phi_dim=8, hidden=16, steps=60, lr=1e-2, loss=loss)
    untrained = value_error(ReZeroMLPFeatureMap(phi_dim=8, hidden=16, seed=0, **shape), held, drop_top=8)
    fmap, log = train_map(train, held, cfg, shape, "cpu")
    assert log[-1]["value"] > 0 and "heldout_value_err" in log[-1]
    assert log[-1]["heldout_value_err"] < untrained, (log[-1], untrained)
