"""k-means++ seeding (``plus_plus_init``) against the step-per-op version it replaced, kept here as the reference:
the same ids bit for bit for the same generator, whatever the shapes, duplicates or degenerate rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from workers.methods import kmeans as km
from workers.methods.kmeans import kmeans, plus_plus_init


def plus_plus_init_reference(x: torch.Tensor, n_clusters: int, g: torch.Generator) -> torch.Tensor:
    """``plus_plus_init`` as of commit 545a8bb (one op per quantity per step), verbatim."""
    h, n, _ = x.shape
    u = torch.rand(h, n_clusters, generator=g, dtype=torch.float64).to(x.device)
    rows = torch.arange(h, device=x.device)
    ids = torch.empty(h, n_clusters, dtype=torch.long, device=x.device)
    ids[:, 0] = (u[:, 0] * n).long().clamp_max(n - 1)
    sq = (x * x).sum(-1)  # [H, n]
    best = torch.full((h, n), torch.inf, dtype=x.dtype, device=x.device)
    for j in range(n_clusters):
        if j:
            w = best.double().clamp_min(0)
            cum = w.cumsum(-1)
            total = cum[:, -1:]
            # all points on a seed already: uniform among them
            cum = torch.where(total > 0, cum, torch.arange(1, n + 1, device=x.device, dtype=torch.float64))
            target = u[:, j:j + 1] * cum[:, -1:]
            ids[:, j] = torch.searchsorted(cum, target, right=True).squeeze(-1).clamp_max(n - 1)
        c = x[rows, ids[:, j]]  # [H, D]
        d = sq - 2 * torch.bmm(x, c.unsqueeze(-1)).squeeze(-1) + (c * c).sum(-1, keepdim=True)
        best = torch.minimum(best, d)
    return ids


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cases() -> list[tuple[str, torch.Tensor, int]]:
    """(name, x, C): Gaussian float32 and bf16-valued keys at Double-P's ratio (C = n / 8), few and many clusters,
    integer keys with exact duplicates (distances exactly 0), a row of one repeated point, and a row narrower than C
    in distinct points (the uniform fallback)."""
    cases = []
    for i, (h, n, d, c) in enumerate([(2, 300, 64, 38), (3, 257, 16, 64), (1, 64, 8, 64), (4, 1000, 128, 125)]):
        x = torch.randn(h, n, d, generator=_gen(10 + i)) * (1 + i)
        cases += [(f"gauss{i}", x, c), (f"bf16_{i}", x.bfloat16().float(), c)]
    ints = torch.randint(-2, 3, (3, 400, 6), generator=_gen(20)).float()
    cases.append(("int duplicates", ints, 60))
    few = torch.randint(-1, 2, (2, 200, 4), generator=_gen(21)).float()[:, torch.arange(200) % 5]
    cases.append(("5 distinct points, 40 seeds", few, 40))
    same = torch.randn(2, 1, 8, generator=_gen(22)).expand(2, 50, 8).contiguous()
    cases.append(("one repeated point", same, 10))
    return cases


@pytest.mark.parametrize(("name", "x", "c"), _cases(), ids=[c[0] for c in _cases()])
def test_plus_plus_init_ids_equal_the_reference_bit_for_bit(name: str, x: torch.Tensor, c: int) -> None:
    for seed in (0, 1, 2):
        g_new, g_ref = _gen(seed), _gen(seed)
        got = plus_plus_init(x, c, g_new)
        want = plus_plus_init_reference(x, c, g_ref)
        assert torch.equal(got, want), (name, seed)
        # the generator advances the same (consecutive calls draw the same fresh seeds)
        assert torch.equal(torch.rand(4, generator=g_new), torch.rand(4, generator=g_ref))


def test_plus_plus_init_on_a_non_contiguous_view() -> None:
    """Double-P clusters segment views of the mid keys."""
    x = torch.randn(2, 600, 32, generator=_gen(30))
    view = x[:, 100:500]
    assert torch.equal(plus_plus_init(view, 50, _gen(3)), plus_plus_init_reference(view.contiguous(), 50, _gen(3)))


def test_kmeans_plus_plus_equals_the_reference_seeds() -> None:
    """The whole ``kmeans`` call (Double-P's) gives the same centroids and labels with either seeding."""
    x = torch.randn(2, 400, 16, generator=_gen(31))
    cent, labels = kmeans(x, 50, iters=3, seed=4, init="plus_plus")
    with mock.patch.object(km, "plus_plus_init", plus_plus_init_reference):
        cent_ref, labels_ref = kmeans(x, 50, iters=3, seed=4, init="plus_plus")
    assert torch.equal(labels, labels_ref) and torch.equal(cent, cent_ref)

