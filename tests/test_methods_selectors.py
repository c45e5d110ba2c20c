"""Selector internals: top-k / top-p ranking, Quest bounds, k-means clusters, Double-P's two stages."""

from __future__ import annotations

import math

import torch

from workers.attention import dense_attention
from workers.methods.doublep import ClusterSummarizer, DoubleP
from workers.methods.kmeans import kmeans
from workers.methods.memory import MemorySource
from workers.methods.quest import QuestBounds
from workers.methods.selector import choose_units, mask_to_index
from workers.requests import DecodeConfig


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_choose_units_budget_and_mass() -> None:
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    sizes = torch.tensor([1, 4, 2, 1])
    r = choose_units(scores, sizes=sizes, budget=6)
    assert r.order[0].tolist() == [1, 2, 0, 3] and r.n_chosen.tolist() == [2, 2]
    assert r.mask()[0].tolist() == [False, True, True, False]
    assert choose_units(scores, p=0.8).n_chosen.tolist() == [2, 4]  # 0.5+0.3 reaches 0.8; uniform needs all 4
    assert choose_units(scores, p=0.81).n_chosen.tolist() == [3, 4]
    assert choose_units(scores, p=0.45).n_chosen.tolist() == [1, 2]
    assert choose_units(scores, p=1.0).n_chosen.tolist() == [4, 4]
    assert choose_units(scores, budget=0).n_chosen.tolist() == [0, 0]
    both = choose_units(scores, sizes=sizes, budget=5, p=0.99)
    assert both.n_chosen.tolist() == [1, 2]  # row 0: sizes 4+2 > 5; row 1 (ties: lower id first): 1+4 fit
    assert both.mask(start=torch.tensor([0, 1]))[1].tolist() == [False, True, False, False]


def test_mask_to_index_puts_valid_ids_first() -> None:
    mask = torch.tensor([[False, True, False, True], [False, False, False, False]])
    ids, counts = mask_to_index(mask, offset=10)
    assert counts.tolist() == [2, 0] and ids.shape == (2, 2) and ids[0].tolist() == [11, 13]


def test_quest_bounds_are_upper_bounds_of_every_page_logit() -> None:
    k = torch.randn(2, 70, 8, generator=_gen(0))
    b = QuestBounds().summarize(0, k, k)
    assert b["kmin"].shape == (2, 5, 8) and int(b["meta"][0]) == 16
    q = torch.randn(8, generator=_gen(1))
    ub = q.clamp_min(0) @ b["kmax"].transpose(-1, -2) + q.clamp_max(0) @ b["kmin"].transpose(-1, -2)
    for page in range(5):
        logits = k[:, page * 16:(page + 1) * 16] @ q
        assert (logits.amax(-1) <= ub[:, page] + 1e-5).all()
        hi = k[:, page * 16:(page + 1) * 16].amax(1)
        torch.testing.assert_close(b["kmax"][:, page], hi)


def test_kmeans_is_deterministic_and_means_are_exact() -> None:
    x = torch.randn(3, 500, 8, generator=_gen(2))
    c1, l1 = kmeans(x, 20, seed=4)
    c2, l2 = kmeans(x, 20, seed=4)
    assert torch.equal(c1, c2) and torch.equal(l1, l2)
    for h in range(3):
        for c in l1[h].unique():
            torch.testing.assert_close(c1[h, c], x[h, l1[h] == c].mean(0))


def test_cluster_summary_order_is_a_cluster_contiguous_permutation() -> None:
    k, v = torch.randn(2, 300, 8, generator=_gen(3)), torch.randn(2, 300, 8, generator=_gen(4))
    s = ClusterSummarizer().summarize(0, k, v)
    lo, hi, c = s["meta"].tolist()
    assert (lo, hi, c) == (4, 284, math.ceil(280 / ClusterSummarizer.cluster_size))
    for h in range(2):
        assert sorted(s["perm"][h].tolist()) == list(range(lo, hi))
        off = s["offsets"][h].long()
        assert off[-1] == hi - lo and (off[1:] - off[:-1] == s["sizes"][h]).all()
        for i in range(c):
            members = s["perm"][h, off[i]:off[i + 1]].long()
            torch.testing.assert_close(s["vsum"][h, i], v[h, members].sum(0), rtol=1e-5, atol=1e-5)
            if len(members):
                torch.testing.assert_close(s["centroids"][h, i], k[h, members].mean(0), rtol=1e-5, atol=1e-5)


def _doublep_case(p1: float, p2: float, budget: float | None):
    k, v = torch.randn(1, 400, 16, generator=_gen(5)), torch.randn(1, 400, 16, generator=_gen(6))
    src = MemorySource.build([(k, v)], [ClusterSummarizer])
    q = torch.randn(1, 2, 1, 16, generator=_gen(7)) * 2
    out, _ = DoubleP(p1=p1, p2=p2).open(src, DecodeConfig(budget=budget)).attend(0, q, 0.25)
    return k, v, q, src, out


def test_doublep_with_unit_masses_is_exact_without_a_budget() -> None:
    k, v, q, _, out = _doublep_case(1.0, 1.0, None)
    torch.testing.assert_close(out, dense_attention(q, k[None], v[None], 0.25)[0], atol=1e-5, rtol=1e-5)


def test_doublep_centroid_entries_follow_eq_9() -> None:
    """p2 tiny and p1 = 1: one cluster per head exact, all others through (bias log s, value V̄)."""
    k, v, q, src, out = _doublep_case(1.0, 1e-9, None)
    art = src.artifact("clusters")
    cent, sizes, vsum = art["0.centroids"][0], art["0.sizes"][0].double(), art["0.vsum"][0].double()
    perm, off = art["0.perm"][0].long(), art["0.offsets"][0].long()
    qg = q[0, :, 0].double()
    est = torch.log(sizes) + 0.25 * (qg @ cent.double().T)  # [G, C]
    best = torch.softmax(est, -1).mean(0).argmax()  # the group's top cluster is the exact one
    anchors = torch.cat([torch.arange(0, 4), torch.arange(384, 400)])
    exact = torch.cat([anchors, perm[off[best]:off[best + 1]]])
    logits = torch.cat([0.25 * qg @ k[0, exact].double().T, est[:, torch.arange(len(sizes)) != best]], -1)
    values = torch.cat([v[0, exact].double(), (vsum / sizes[:, None])[torch.arange(len(sizes)) != best]])
    ref = torch.softmax(logits, -1) @ values
    torch.testing.assert_close(out[0, :, 0].double(), ref, atol=1e-5, rtol=1e-5)


def test_doublep_stage1_drops_the_tail_of_clusters() -> None:
    k, v, q, src, _ = _doublep_case(0.5, 1e-9, None)
    attn = DoubleP(p1=0.5, p2=1e-9).open(src, DecodeConfig())
    attn.attend(0, q, 0.25)
    kept = attn.read_report().extra["pseudo_entries_per_step"]
    attn_all = DoubleP(p1=1.0, p2=1e-9).open(src, DecodeConfig())
    attn_all.attend(0, q, 0.25)
    n_clusters = int(src.artifact("clusters")["0.meta"][2])
    assert kept < attn_all.read_report().extra["pseudo_entries_per_step"] == n_clusters - 1  # all but the exact one
