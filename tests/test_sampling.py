"""``sample_rows``: the step's tokens in one batched choice equal each sampler's own choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.requests import SamplingParams
from workers.sampling import Sampler, pick_rows, sample_rows


def test_sample_rows_equals_each_sampler() -> None:
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(50, generator=g) for _ in range(5)]
    rows[1][7] = rows[1][3] = rows[1].max() + 1  # a tie: the first maximum wins, as one row's argmax
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(),
              SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    batched = sample_rows([Sampler(p, cpu) for p in params], rows)
    alone = [Sampler(p, cpu)(r) for p, r in zip(params, rows, strict=True)]
    assert batched == alone
    assert batched[0] == int(rows[0].argmax()) and sample_rows([Sampler(params[0], cpu)], [rows[1]]) == [3]


def test_sample_rows_empty() -> None:
    assert sample_rows([], []) == []


def test_rows_of_one_setting_are_sampled_together_and_as_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows sharing (temperature, top_p), also not adjacent ones, are one softmax / sort / scan; every row still
    gets the token its sampler picks alone, step after step (each generator advanced once per step)."""
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    a, b = SamplingParams(temperature=0.8, top_p=0.9, seed=0), SamplingParams(temperature=1.2, top_p=0.5, seed=0)
    params = [a, SamplingParams(), a, a, b, SamplingParams(), a, b]
    batch = [Sampler(dataclasses.replace(p, seed=i), cpu) for i, p in enumerate(params)]
    alone = [Sampler(dataclasses.replace(p, seed=i), cpu) for i, p in enumerate(params)]
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *x, **k: sorts.append(1) or real_sort(*x, **k))
    for _ in range(10):
        logits = torch.randn(len(params), 300, generator=g) * 3
        sorts.clear()
        got = pick_rows(batch, logits).tolist()
        assert len(sorts) == 2  # one per setting, not one per row
        assert got == [int(s.pick(row)) for s, row in zip(alone, logits, strict=True)]


def test_a_generations_draws_do_not_depend_on_its_batch() -> None:
    cpu = torch.device("cpu")
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(2))
    first = Sampler(p, cpu)
    together = [first, *(Sampler(dataclasses.replace(p, seed=s), cpu) for s in (1, 2, 3))]
    solo = Sampler(p, cpu)
    for _ in range(5):
        assert int(pick_rows(together, logits)[0]) == int(pick_rows([solo], logits[:1])[0])
