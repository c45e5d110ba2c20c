"""Selection at partial budgets: the product selectors pick exactly what their definitions rank first.

Each expectation is computed here from first principles (brute-force logits over the keys), so
an inverted or shuffled ranking in a selector fails these tests, not only an end-to-end answer.
"""

from __future__ import annotations

import types

import pytest
import torch

from workers.methods.key_index import KeyIndexSummarizer, dequantize_keys
from workers.methods.quest import QuestBounds, QuestSelector
from workers.methods.selector import LayerContext
from workers.methods.topk import ExactTopKSelector, IndexedTopKSelector

PAGE = 16


def _keys(seed: int, hkv: int = 2, n: int = 16 * 12, d: int = 8) -> torch.Tensor:
    return torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(seed))


def _ctx(k: torch.Tensor, lo: int, hi: int) -> LayerContext:
    kv = types.SimpleNamespace(n_tokens=k.shape[1], device=k.device, n_heads=k.shape[0], head_dim=k.shape[2],
                               dtype=k.dtype, mid_keys=lambda a, b: k[:, a:b],
                               keys=lambda ids: k[torch.arange(k.shape[0]).view(1, -1, 1), ids])
    return LayerContext(kv, lo, hi)  # type: ignore[arg-type]


def _group_mass(logits: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, G, U] -> mean over the group of each head's softmax (the selectors' definition)."""
    return torch.softmax(logits, dim=-1).mean(dim=-2)


def _quest_page_scores(k: torch.Tensor, q: torch.Tensor, p0: int, p1: int, scale: float) -> torch.Tensor:
    """Brute force: each page's upper bound max_j sum_d max(q_d kmax_d, q_d kmin_d), group-mass ranked."""
    out = []
    for p in range(p0, p1):
        page = k[:, p * PAGE:(p + 1) * PAGE]  # [Hkv, P, D]
        kmax, kmin = page.amax(1), page.amin(1)  # [Hkv, D]
        ub = torch.maximum(q * kmax[None, :, None], q * kmin[None, :, None]).sum(-1)  # [T, Hkv, G]
        out.append(ub * scale)
    return _group_mass(torch.stack(out, dim=-1))


@pytest.mark.parametrize(("n_pages", "lo", "hi"), [(1, 16, 176), (3, 16, 176), (5, 20, 170), (8, 4, 192)])
def test_quest_picks_the_pages_with_the_highest_upper_bounds(n_pages: int, lo: int, hi: int) -> None:
    k = _keys(0)
    b = QuestBounds().summarize(0, k, k)
    sel = QuestSelector({f"0.{name}": t for name, t in b.items()})
    q = torch.randn(3, 2, 2, 8, generator=torch.Generator().manual_seed(1))  # [T, Hkv, G, D]
    ctx = _ctx(k, lo, hi)
    p0, p1 = lo // PAGE, -(-hi // PAGE)
    picked = sel.select_pages(0, ctx, q, 0.5, n_pages)  # [T, Hkv, n]
    scores = _quest_page_scores(k, q, p0, p1, 0.5)  # [T, Hkv, U]
    want = scores.topk(n_pages, dim=-1).indices + p0
    assert torch.equal(picked.sort(-1).values, want.sort(-1).values)
    # the token-granular path attends exactly the mid tokens of the same pages
    s = sel.select(0, ctx, q, 0.5, n_pages * PAGE)
    for t in range(3):
        for h in range(2):
            got = set(s.tokens[t, h, : int(s.counts[t, h])].tolist())
            assert got and all(lo <= i < hi for i in got)
            touched = {i // PAGE for i in got}
            # whole pages only, and the best-ranked ones: a prefix of the ranking (boundary pages hold fewer
            # mid tokens, so a token budget may admit more pages than n_pages, never a worse one first)
            assert got == {i for p in touched for i in range(p * PAGE, (p + 1) * PAGE) if lo <= i < hi}
            ranking = (scores[t, h].argsort(descending=True) + p0).tolist()
            assert touched == set(ranking[: len(touched)])
            assert len(touched) >= n_pages


@pytest.mark.parametrize("k_tokens", [1, 7, 40, 150])
def test_topk_picks_the_tokens_with_the_most_group_mass(k_tokens: int) -> None:
    k = _keys(2)
    lo, hi = 4, 180
    sel = ExactTopKSelector()
    ctx = _ctx(k, lo, hi)
    sel.prepare(0, ctx)
    q = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(3))
    s = sel.select(0, ctx, q, 0.25, k_tokens)
    logits = torch.einsum("thgd,hnd->thgn", q, k[:, lo:hi]) * 0.25
    want = _group_mass(logits).topk(k_tokens, dim=-1).indices + lo
    assert torch.equal(s.tokens.sort(-1).values, want.sort(-1).values)
    assert (s.counts == k_tokens).all()


@pytest.mark.parametrize("k_tokens", [1, 7, 40, 150])
def test_indexed_topk_picks_the_shortlist_tokens_with_the_most_group_mass(k_tokens: int) -> None:
    """The indexed selector's final pick is exact Top-K restricted to the index's shortlist: the shortlist
    is the index's best ``2k`` by group mass, and among it the best ``k`` by exact logits (each head's
    softmax normalized over the whole mid region on the index)."""
    k = _keys(4)
    lo, hi = 4, 180
    sel = IndexedTopKSelector({f"0.{n}": t for n, t in KeyIndexSummarizer().summarize(0, k, k).items()})
    ctx = _ctx(k, lo, hi)
    q = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(5))
    s = sel.select(0, ctx, q, 0.25, k_tokens)
    approx = sel.approx_logits(0, ctx, q, 0.25)
    short = _group_mass(approx).topk(min(hi - lo, 2 * k_tokens), dim=-1).indices  # [T, Hkv, S]
    assert s.scored is not None
    assert torch.equal(s.scored.sort(-1).values, (short + lo).sort(-1).values)
    exact = torch.einsum("thgd,hnd->thgn", q, k[:, lo:hi]) * 0.25
    mass = torch.exp(exact - torch.logsumexp(approx, -1, keepdim=True)).mean(2)  # [T, Hkv, n_mid]
    masked = torch.full_like(mass, -1.0).scatter(-1, short, mass.gather(-1, short))
    want = masked.topk(k_tokens, dim=-1).indices + lo
    assert torch.equal(s.tokens.sort(-1).values, want.sort(-1).values)
    assert (s.counts == k_tokens).all()


@pytest.mark.parametrize(("n_pages", "lo", "hi"), [(1, 16, 176), (3, 16, 176), (5, 20, 170), (8, 4, 192)])
def test_page_topk_picks_the_pages_holding_the_most_index_mass(n_pages: int, lo: int, hi: int) -> None:
    """Page-granular indexed Top-K: per row, the pages whose mid tokens carry the most group mass on the
    dequantized index (softmax over the mid region per query head, mean over the group, summed per page)."""
    k = _keys(6)
    art = KeyIndexSummarizer().summarize(0, k, k)
    sel = IndexedTopKSelector({f"0.{n}": t for n, t in art.items()}, page_size=PAGE)
    q = torch.randn(3, 2, 2, 8, generator=torch.Generator().manual_seed(7))
    picked = sel.select_pages(0, _ctx(k, lo, hi), q, 0.5, n_pages)
    keys = dequantize_keys(art["codes"], art["lo"], art["step"], int(art["meta"][0]), int(art["meta"][1]))
    mass = _group_mass(torch.einsum("thgd,hnd->thgn", q, keys[:, lo:hi]) * 0.5)  # [T, Hkv, n_mid]
    p0, p1 = lo // PAGE, -(-hi // PAGE)
    for t in range(3):
        for h in range(2):
            per_page = [float(sum(mass[t, h, i - lo] for i in range(p * PAGE, (p + 1) * PAGE) if lo <= i < hi))
                        for p in range(p0, p1)]
            want = sorted(range(p0, p1), key=lambda p: -per_page[p - p0])[:n_pages]
            assert sorted(picked[t, h].tolist()) == sorted(want)
