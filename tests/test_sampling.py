"""``sample_rows``: the step's tokens in one batched choice equal each sampler's own choice."""

from __future__ import annotations

import torch

from workers.requests import SamplingParams
from workers.sampling import Sampler, sample_rows


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
