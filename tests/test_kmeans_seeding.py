"""k-means++ seeding (``plus_plus_init``) against the step-per-op version it replaced, kept here as the reference:
the same ids bit for bit for the same generator, whatever the shapes, duplicates or degenerate rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from workers.methods import kmeans as km
from workers.methods.doublep import ClusterSummarizer
from workers.methods.kmeans import SeedGraphs, batch_sizes, kmeans, plus_plus_batched_init, plus_plus_init


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
    with mock.patch.object(km, "plus_plus_init", lambda x, c, g, graphs=None: plus_plus_init_reference(x, c, g)):
        cent_ref, labels_ref = kmeans(x, 50, iters=3, seed=4, init="plus_plus")
    assert torch.equal(labels, labels_ref) and torch.equal(cent, cent_ref)


# plus_plus_batched: k-means++ in rounds of several draws (not the default; see kmeans.INITS)


def test_batch_sizes_ramp_then_cap() -> None:
    assert batch_sizes(1) == []
    assert batch_sizes(2) == [1]
    assert batch_sizes(510, rounds=16) == [1, 2, 4, 8, 16, 32] + [32] * 13 + [30]
    for c in (3, 17, 100, 2048):
        assert sum(batch_sizes(c)) == c - 1 and max(batch_sizes(c)) == -(-(c - 1) // 16)
    assert batch_sizes(100, rounds=1000) == [1] * 99


@pytest.mark.parametrize(("name", "x", "c"), _cases(), ids=[c[0] for c in _cases()])
def test_batched_with_one_seed_per_round_is_plus_plus(name: str, x: torch.Tensor, c: int) -> None:
    """One seed per round: the same uniforms, distances and draws as k-means++, bit for bit."""
    for seed in (0, 1):
        assert torch.equal(plus_plus_batched_init(x, c, _gen(seed), rounds=c), plus_plus_init(x, c, _gen(seed))), name


def test_batched_is_seeded_distinct_and_in_range() -> None:
    x = torch.randn(3, 2000, 32, generator=_gen(40))
    a, b = plus_plus_batched_init(x, 250, _gen(7)), plus_plus_batched_init(x, 250, _gen(7))
    assert torch.equal(a, b) and a.shape == (3, 250) and int(a.min()) >= 0 and int(a.max()) < 2000
    # no point dominates a Gaussian cloud's weight: every draw is a different point
    assert all(torch.unique(a[h]).numel() == 250 for h in range(3))
    assert not torch.equal(a, plus_plus_batched_init(x, 250, _gen(8)))


def test_batched_never_redraws_a_seeded_point_in_a_later_round() -> None:
    """As in k-means++ points on a seed weigh 0: a key seeded in one round is not drawn in a later one (12 distinct
    keys, 20 copies each). Within a round a key can be drawn twice (it holds over 1 / b of the weight)."""
    kind = torch.randint(-3, 4, (2, 12, 8), generator=_gen(41)).float()
    x = kind[:, torch.randperm(240, generator=_gen(42)) % 12]
    sizes = batch_sizes(12, rounds=4)
    assert sizes == [1, 2, 3, 3, 2]
    for seed in range(5):
        ids = plus_plus_batched_init(x, 12, _gen(seed), rounds=4)
        for h in range(2):
            keys = (x[h, ids[h]] * 7 ** torch.arange(8)).sum(-1).tolist()  # one number per integer key
            seen, at = {keys[0]}, 1
            for b in sizes:
                batch = set(keys[at:at + b])
                if len(seen) < 12:
                    assert not batch & seen, (seed, h, at)
                seen |= batch
                at += b


def test_batched_cost_beats_random_seeds() -> None:
    """Well-separated blobs: the D^2 draws cover them about as k-means++ does, far better than uniform seeds
    (the potential after Lloyd, mean over seeds)."""
    centers = torch.randn(1, 40, 16, generator=_gen(43)) * 20
    sizes = torch.randint(5, 200, (40,), generator=_gen(44))
    blob = torch.repeat_interleave(torch.arange(40), sizes)
    x = centers[:, blob] + torch.randn(1, blob.numel(), 16, generator=_gen(45))

    def cost(init: str) -> float:
        total = 0.0
        for s in range(4):
            cent, lab = kmeans(x, 40, iters=10, seed=s, init=init)
            total += float((x - cent.gather(1, lab[..., None].expand(-1, -1, 16))).square().sum())
        return total / 4

    batched, pp, rand = cost("plus_plus_batched"), cost("plus_plus"), cost("random")
    assert batched < 0.5 * rand and batched < 2 * pp, (batched, pp, rand)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("shape", [(3, 500, 64), (2, 4076, 128)])
def test_graphed_seeding_gives_the_eager_ids_on_every_replay(shape: tuple[int, int, int]) -> None:
    h, n, d = shape
    c = -(-n // 8)
    graphs = SeedGraphs()
    for call in range(3):  # the first call captures, the next ones replay over new keys
        x = torch.randn(h, n, d, generator=torch.Generator().manual_seed(10 + call)).cuda()
        want = plus_plus_init(x, c, torch.Generator().manual_seed(call))
        got = plus_plus_init(x, c, torch.Generator().manual_seed(call), graphs)
        assert torch.equal(got, want)
    assert graphs.captures == 1 and graphs.replays == 3


@needs_cuda
def test_a_doublep_build_on_cuda_seeds_through_graphs_with_the_eager_clusters() -> None:
    k = torch.randn(2, 3000, 64, generator=torch.Generator().manual_seed(5)).cuda()
    v = torch.randn_like(k)
    graphed = ClusterSummarizer()
    graphed.graphed_seeding = True  # off by default until measured on a GPU
    eager = ClusterSummarizer()
    eager._graphs = lambda x: None  # type: ignore[method-assign]
    for layer in range(2):
        a, b = graphed.summarize(layer, k, v), eager.summarize(layer, k, v)
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert graphed.seed_graphs is not None and graphed.seed_graphs.replays == 2


def test_graphs_are_not_used_off_cuda() -> None:
    x = torch.randn(2, 300, 16, generator=torch.Generator().manual_seed(0))
    graphs = SeedGraphs()
    assert torch.equal(plus_plus_init(x, 40, torch.Generator().manual_seed(1), graphs),
                       plus_plus_init(x, 40, torch.Generator().manual_seed(1)))
    assert graphs.captures == 0 and graphs.replays == 0
    on = ClusterSummarizer()
    on.graphed_seeding = True
    assert on._graphs(x) is None and ClusterSummarizer()._graphs(x) is None
