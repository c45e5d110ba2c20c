"""LookaheadKV training on the CPU: the paper's loss falls on a sample trained on, and the run writes a loadable
adapter tied to its model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lab.train.lookahead import kl_loss, main, step_loss, target
from tests.conftest import TEST_PAGE_SIZE
from tests.test_methods import DOC
from workers.lookahead_adapter import LookaheadAdapter, LookaheadConfig
from workers.model import LoadedModel, load_model


def test_kl_loss_is_zero_only_on_matching_scores() -> None:
    gt = {0: torch.rand(4, 30) + 0.01, 1: torch.rand(4, 30) + 0.01}
    assert float(kl_loss(gt, {k: 3 * v for k, v in gt.items()})) < 1e-6  # normalized: scale does not matter
    assert float(kl_loss(gt, {k: torch.ones_like(v) for k, v in gt.items()})) > 1e-3


def test_training_steps_lower_the_loss_of_a_sample(endless_lm: LoadedModel) -> None:
    lm = endless_lm  # its greedy answers never end early: a ground truth of several tokens
    t = target(lm, DOC, " What is the code?", max_answer=6)
    assert t is not None and t.gt[0].shape == (lm.model.config.num_attention_heads, len(lm.tokenizer(DOC).input_ids))
    adapter = LookaheadAdapter(lm.model, LookaheadConfig(n_lookahead=4, rank=4))
    try:
        opt = torch.optim.Adam(adapter.parameters(), lr=1e-2)
        losses = []
        for _ in range(15):
            loss = step_loss(lm, adapter, t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        adapter.detach_hooks()
    assert losses[-1] < 0.7 * losses[0], losses


def test_cli_writes_an_adapter_the_loader_takes(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    main(["--model", str(model), "--minutes", "1", "--steps", "2", "--lengths", "400", "--n-lookahead", "3",
          "--rank", "2", "--updates-per-sample", "1", "--device", "cpu"])
    assert (model / "lookahead.safetensors").is_file() and (model / "lookahead.json").is_file()
    assert json.loads((model / "lookahead.json").read_text())["train"]["device"] == "cpu"
    lm = load_model(str(model), page_size=TEST_PAGE_SIZE, progress=False)
    assert lm.lookahead is not None and lm.lookahead.config.n_lookahead == 3
