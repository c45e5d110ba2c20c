"""Double-P's k-means seeding (k-means++): a rare key far from a repetitive haystack gets a cluster of its own, so
its centroid is itself (issue 14: a variable-tracking needle sharing its cluster with haystack keys)."""

from __future__ import annotations

import pytest
import torch

from workers.methods.doublep import ClusterSummarizer
from workers.methods.kmeans import kmeans, plus_plus_init

SINK, TAIL = 4, 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _haystack(hkv: int, kinds: int, repeats: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kinds`` integer-valued keys (exact float arithmetic) each repeated ``repeats`` times, shuffled per head:
    ``[Hkv, kinds * repeats, D]``, and the kinds ``[Hkv, kinds, D]``."""
    kind = torch.randint(-3, 4, (hkv, kinds, d), generator=_gen(seed)).float()
    order = torch.stack([torch.randperm(kinds * repeats, generator=_gen(seed + 1 + h)) % kinds for h in range(hkv)])
    return kind.gather(1, order[..., None].expand(-1, -1, d)), kind


def test_plus_plus_seeds_every_distinct_point_once_before_any_repeat() -> None:
    """Points equal to a seed have distance 0: once every distinct point is a seed, nothing else can be drawn, and
    none is drawn twice before that."""
    x, _ = _haystack(3, 12, 20, 8, seed=1)
    ids = plus_plus_init(x, 12, _gen(5))
    for h in range(3):
        picked = x[h, ids[h]]
        assert torch.unique(picked, dim=0).shape[0] == 12, h


def test_plus_plus_is_seeded_and_in_range() -> None:
    x = torch.randn(2, 300, 8, generator=_gen(2))
    a, b = plus_plus_init(x, 40, _gen(7)), plus_plus_init(x, 40, _gen(7))
    assert torch.equal(a, b) and a.shape == (2, 40) and int(a.min()) >= 0 and int(a.max()) < 300
    assert all(torch.unique(a[h]).numel() == 40 for h in range(2))  # distinct points are never drawn twice


def test_kmeans_init_is_checked() -> None:
    with pytest.raises(ValueError, match="init"):
        kmeans(torch.randn(1, 10, 4), 2, init="furthest")


@pytest.mark.parametrize("init", ["plus_plus", "random"])
def test_kmeans_means_are_exact_for_either_init(init: str) -> None:
    x = torch.randn(2, 200, 8, generator=_gen(3))
    cent, labels = kmeans(x, 16, seed=1, init=init)
    for h in range(2):
        for c in labels[h].unique():
            torch.testing.assert_close(cent[h, c], x[h, labels[h] == c].mean(0))


def test_summary_gives_planted_keys_clusters_of_their_own() -> None:
    """A repetitive haystack (fewer distinct keys than clusters) with three planted keys far from it: the product's
    clustering (``ClusterSummarizer``, k-means++ seeding) puts each planted key alone in its cluster; uniformly drawn
    seeds leave most of them inside a haystack cluster (a seed lands on a given key with probability 1/8)."""
    hkv, d = 2, 8
    hay, _ = _haystack(hkv, 10, 40, d, seed=11)
    planted = torch.full((hkv, 3, d), 40.0) * torch.tensor([1.0, -1.0, 0.5])[None, :, None]
    at = torch.tensor([37, 201, 355])
    mid = hay.clone()
    mid[:, at] = planted
    k = torch.cat([torch.zeros(hkv, SINK, d), mid, torch.zeros(hkv, TAIL, d)], dim=1)
    v = torch.randn_like(k)
    s = ClusterSummarizer().summarize(0, k, v)
    assert ClusterSummarizer.init == "plus_plus"
    perm, off = s["perm"].long(), s["offsets"].long()
    for h in range(hkv):
        for token in (at + SINK).tolist():
            pos = int((perm[h] == token).nonzero())
            c = int(torch.searchsorted(off[h, 1:], torch.tensor(pos), right=True))
            assert int(s["sizes"][h, c]) == 1, (h, token)
            torch.testing.assert_close(s["centroids"][h, c], k[h, token])
