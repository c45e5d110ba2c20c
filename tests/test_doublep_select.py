"""Double-P's per-step selection equals its earlier, op-by-op form bit for bit (and its CPU sorts torch's).

``DoublePSelector.select`` computes the two top-p prefixes from one cumulative mass, sorts only the ranks a
budget can take, expands the exact clusters from their rank-ordered prefix and reads per-generation constants
made in ``prepare``. The oracle below is the selection as it was written before (``choose_units`` twice,
``shared_top_p`` over whole rows, a cluster mask expanded through ``nonzero``, ``mask_to_index``): every tensor
of the ``Selection`` and its read accounting must be the same, over budgets that bind, budgets that cover the
mid region, no budget, several query rows, and mid regions narrower than the summary (emptied clusters).
"""

from __future__ import annotations

import pytest
import torch

from workers.kernels import doublep_select as dp_kernel
from workers.methods import doublep
from workers.methods.doublep import ClusterSummarizer, DoublePSelector, _rank, _sort_rows, _valid_first
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.selector import (
    LayerContext,
    Ranked,
    Selection,
    choose_units,
    group_mass,
    mask_to_index,
    rank_units,
)
from workers.methods.sparse import _append

SINK, TAIL = 4, 16


def _shared_top_p_reference(mass: torch.Tensor, sizes: torch.Tensor, order: torch.Tensor, limit: torch.Tensor,
                            budget: int, groups: int) -> torch.Tensor:
    r, u = mass.shape
    m = mass.gather(1, order).double()
    before = (m.cumsum(-1) - m) / m.sum(-1, keepdim=True).clamp_min(1e-300)
    eligible = torch.arange(u) < limit[:, None]
    entry = torch.where(eligible, before, torch.inf).reshape(groups, -1)
    by_entry = torch.sort(entry, dim=-1, stable=True).indices
    cost = sizes.gather(1, order).reshape(groups, -1).gather(1, by_entry).cumsum(-1)
    take = (cost <= budget) & entry.gather(1, by_entry).isfinite()
    return torch.zeros_like(take).scatter_(1, by_entry, take).reshape(r, u).sum(-1)


def _cluster_tokens_reference(sizes: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor, heads: torch.Tensor,
                              exact: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    r_idx, c_idx = exact.nonzero(as_tuple=True)
    h_idx = heads[r_idx]
    lens = sizes[h_idx, c_idx]
    counts = torch.zeros(exact.shape[0], dtype=torch.long).index_add_(0, r_idx, lens)
    width = int(counts.max()) if counts.numel() else 0
    total = int(lens.sum())
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=total)
    within = torch.arange(total) - (lens.cumsum(0) - lens)[seg]
    ids = perm[h_idx[seg], offsets[h_idx, c_idx][seg] + within]
    row = r_idx[seg]
    col = torch.arange(total) - (counts.cumsum(0) - counts)[row]
    big = torch.iinfo(torch.long).max
    out = torch.full((exact.shape[0], width), big, dtype=torch.long)
    out[row, col] = ids.long()
    out = torch.sort(out, dim=-1).values
    return torch.where(out == big, pad, out), counts


def _select_reference(sel: DoublePSelector, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float,
                      k: int | None) -> Selection:
    cl = sel._layers[layer]
    t, hkv = q.shape[0], q.shape[1]
    n_clusters = cl.centroids.shape[1]
    logits = torch.einsum("thgd,hcd->thgc", q.float(), cl.centroids) * scale + cl.log_sizes[:, None]
    mass = group_mass(logits).reshape(t * hkv, -1)
    order = rank_units(mass)
    sizes = cl.sizes.expand(t, -1, -1).reshape(t * hkv, -1)
    if k is not None and k >= ctx.n_mid:
        stage1 = n_exact = torch.full((t * hkv,), n_clusters, dtype=torch.long)
    else:
        stage1 = choose_units(mass, p=sel.p1, order=order).n_chosen
        n_exact = torch.minimum(choose_units(mass, p=sel.p2, order=order).n_chosen, stage1)
        if k is not None:
            n_exact = _shared_top_p_reference(mass, sizes, order, n_exact, budget=k * hkv, groups=t)
    heads = torch.arange(hkv).repeat(t)
    ids, counts = _cluster_tokens_reference(cl.sizes, cl.perm, cl.offsets, heads, Ranked(order, n_exact).mask(),
                                            pad=ctx.lo)
    index_bytes = hkv * n_clusters * (cl.centroids.shape[-1] * cl.centroids.element_size() + 4) + (
        n_exact.sum() * 2 * cl.offsets.element_size() + counts.sum() * cl.perm.element_size())
    out = Selection(tokens=ids.reshape(t, hkv, -1), counts=counts.reshape(t, hkv), index_bytes=index_bytes)
    if not sel.centroid_fallback:
        return out
    approx = Ranked(order, stage1).mask(start=n_exact) & (sizes > 0)
    cids, ccounts = mask_to_index(approx)
    index_bytes = index_bytes + ccounts.sum() * 2 * cl.centroids.shape[-1] * ctx.kv.dtype.itemsize
    return Selection(tokens=out.tokens, counts=out.counts, centroids=cids.reshape(t, hkv, -1),
                     n_centroids=ccounts.reshape(t, hkv), index_bytes=index_bytes)


def _assert_same(got: Selection, want: Selection) -> None:
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.counts, want.counts)
    assert int(got.index_bytes) == int(want.index_bytes)
    assert (got.centroids is None) == (want.centroids is None)
    if want.centroids is not None:
        assert got.centroids is not None and got.n_centroids is not None and want.n_centroids is not None
        assert torch.equal(got.centroids, want.centroids)
        assert torch.equal(got.n_centroids, want.n_centroids)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("path", ["kernel", "host", "torch"])
def test_select_equals_the_earlier_op_by_op_selection(seed: int, t: int, narrow: bool, path: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path: the CPU kernel (``CPU_KERNEL``), the CPU's numpy bookkeeping (``HOST_BOOKKEEPING``) and the torch
    ops other devices run."""
    if path == "kernel" and not dp_kernel.cpu_kernel_available():
        pytest.skip("no C++ compiler: the CPU Double-P kernel is not built")
    monkeypatch.setattr(doublep, "HOST_BOOKKEEPING", path != "torch")
    monkeypatch.setattr(doublep, "CPU_KERNEL", path == "kernel")
    calls = []
    if path == "kernel":
        pick = dp_kernel.DoublePKernel.pick
        monkeypatch.setattr(dp_kernel.DoublePKernel, "pick", lambda *a, **kw: calls.append(1) or pick(*a, **kw))
    gen = torch.Generator().manual_seed(seed)
    hkv, g, d, n = 2, 4, 16, 900 + 37 * seed
    topic = torch.randint(n // 40, (n,), generator=gen).sort().values  # topics of nearby keys: uneven mass
    k = torch.randn(hkv, n // 40, d, generator=gen)[:, topic] + 0.5 * torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    src = MemorySource.build([(k, v)], [ClusterSummarizer])
    scale = d ** -0.5
    # a mid region narrower than the summary's: the anchors it gains leave their clusters (some empty)
    lo, hi = (SINK + 45, n - TAIL - 30) if narrow else (SINK, n - TAIL)
    ctx = LayerContext(ResidentKV(k, v, page_size=16), lo, hi)
    # p1 > 1: every cluster is in stage 1, the emptied ones too (they must not become centroid entries)
    for p1, p2, fallback in [(0.95, 0.7, True), (0.99, 0.9, False), (0.6, 0.2, True), (1.5, 0.7, True)]:
        sel = DoublePSelector(src, p1=p1, p2=p2, centroid_fallback=fallback)
        sel.prepare(0, ctx)
        if narrow:
            assert (sel._layers[0].sizes == 0).any()
        for step in range(2):
            q = torch.randn(t, hkv, g, d, generator=gen) * (0.5 + 2 * step)  # flat to sharp attention
            for budget in (None, 8, 40, 150, ctx.n_mid):
                _assert_same(sel.select(0, ctx, q, scale, budget), _select_reference(sel, 0, ctx, q, scale, budget))
    assert bool(calls) == (path == "kernel")


def _compact_reference(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sparse path's earlier join of (ids, valid, bias) parts: concatenated, valid entries first (a sort)."""
    idx = torch.cat([p[0] for p in parts], dim=-1)
    valid = torch.cat([p[1] for p in parts], dim=-1)
    bias = torch.cat([p[2] if p[2] is not None else torch.zeros(p[0].shape) for p in parts], -1)
    order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
    return idx.gather(-1, order), valid.sum(-1), bias.gather(-1, order).contiguous()


@pytest.mark.parametrize("t,w1,w2", [(1, 9, 5), (3, 4, 11), (2, 7, 0), (1, 0, 6)])
def test_append_puts_the_same_valid_entries_in_the_same_order_as_the_sorting_join(t: int, w1: int, w2: int) -> None:
    """The centroid entries joined after a step's token rows (``sparse._append``) == the sort-based join."""
    gen = torch.Generator().manual_seed(t * 100 + w1 * 10 + w2)
    hkv = 2
    ids, more = torch.randint(0, 1000, (t, hkv, w1), generator=gen), torch.randint(0, 1000, (t, hkv, w2), generator=gen)
    n, n_more = torch.randint(0, w1 + 1, (t, hkv), generator=gen), torch.randint(0, w2 + 1, (t, hkv), generator=gen)
    n.view(-1)[0], n_more.view(-1)[-1] = w1, w2  # full rows too
    more_bias = torch.randn(t, hkv, w2, generator=gen)
    got_ids, got_n, got_bias = _append(ids, n, more, n_more, more_bias)
    prefix = [torch.arange(w) < c.unsqueeze(-1) for w, c in ((w1, n), (w2, n_more))]
    want_ids, want_n, want_bias = _compact_reference([(ids, prefix[0], None), (more, prefix[1], more_bias)])
    assert got_ids.shape == want_ids.shape and got_bias.shape == want_bias.shape
    assert got_n.dtype == want_n.dtype and torch.equal(got_n, want_n)
    valid = torch.arange(w1 + w2) < want_n.unsqueeze(-1)
    assert torch.equal(got_ids[valid], want_ids[valid]) and torch.equal(got_bias[valid], want_bias[valid])


@pytest.mark.parametrize("u", [1, 7, 507, 5000])
def test_cpu_ranking_and_sorts_equal_the_torch_ops(u: int) -> None:
    """The CPU's numpy sorts (int64 keys for the ranking, in-place value sort, stable mask order) == torch's."""
    gen = torch.Generator().manual_seed(u)
    mass = torch.softmax(torch.randn(3, 4, u, generator=gen) * 4, -1).mean(1)
    mass[0, : u // 3] = 0.0  # ties at zero
    mass[1, ::2] = mass[1, 0]  # ties at a positive mass
    mass[2, -1] = torch.finfo(torch.float32).tiny / 4  # a subnormal
    assert torch.equal(_rank(mass), rank_units(mass))
    ids = torch.randint(0, 50, (3, u), generator=gen)
    assert torch.equal(_sort_rows(ids.clone()), torch.sort(ids, dim=-1).values)
    mask = torch.rand(3, u, generator=gen) < 0.4
    width = int(mask.sum(-1).max())
    assert torch.equal(_valid_first(mask, width), mask_to_index(mask)[0])
