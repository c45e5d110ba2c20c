"""Double-P's CPU bookkeeping kernel (``workers/kernels/doublep_select``) == its plain torch reference, bit for bit.

Over masses with ties (at zero and at a positive mass), one and several query rows (groups sharing a budget),
budgets that bind, that take nothing and that never bind, no budget, every cluster exact, empty clusters, and
with and without the centroid fallback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.kernels.doublep_select import (
    DoublePKernel,
    DoublePPick,
    cpu_kernel_available,
    doublep_select,
    doublep_select_ref,
    ops,
)

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the kernel is not built")


def _case(seed: int, t: int, hkv: int, c: int, n_mid: int, empty: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t * hkv, 4, c, generator=gen) * (0.5 + 3 * (seed % 3))
    mass = torch.softmax(logits, -1).mean(1)
    mass[0, : c // 4] = 0.0  # ties at zero
    if t * hkv > 1:
        mass[1, ::3] = mass[1, 0]  # ties at a positive mass
    sizes = torch.zeros(hkv, c, dtype=torch.long)
    for h in range(hkv):  # n_mid tokens over c clusters, some empty
        lab = torch.randint(max(1, c // 2) if empty else c, (n_mid,), generator=gen)
        sizes[h] = torch.bincount(lab, minlength=c)
    offsets = torch.cat([torch.zeros(hkv, 1, dtype=torch.long), sizes.cumsum(1)], 1)
    starts = (offsets[:, :-1] + torch.arange(hkv)[:, None] * n_mid).contiguous()
    perm = torch.stack([torch.randperm(n_mid, generator=gen) + 7 for _ in range(hkv)]).int().view(-1)
    return mass, sizes, starts, (sizes > 0).contiguous(), perm


def _same(got: DoublePPick, want: DoublePPick) -> None:
    assert torch.equal(got.tokens, want.tokens) and got.tokens.dtype == want.tokens.dtype
    assert torch.equal(got.counts, want.counts)
    assert (got.n_ids, got.n_exact, got.n_approx) == (want.n_ids, want.n_exact, want.n_approx)
    assert (got.centroids is None) == (want.centroids is None)
    if want.centroids is not None:
        assert got.centroids is not None
        assert torch.equal(got.centroids, want.centroids) and torch.equal(got.n_centroids, want.n_centroids)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("t,hkv,c,n_mid", [(1, 2, 1, 9), (1, 2, 37, 300), (3, 2, 256, 2000), (2, 1, 513, 4000),
                                           (1, 8, 1000, 8000)])
@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("fallback", [True, False])
@pytest.mark.parametrize("one_call", [True, False])
def test_kernel_equals_the_torch_reference(seed: int, t: int, hkv: int, c: int, n_mid: int, empty: bool,
                                           fallback: bool, one_call: bool) -> None:
    """Both forms: one call (the kernel's own torch-order row sums) and two calls around torch's sum."""
    mass, sizes, starts, nonempty, perm = _case(seed, t, hkv, c, n_mid, empty)
    kernel = DoublePKernel(sizes, starts, nonempty, perm)
    if one_call and kernel._lib.sum_width is None:
        pytest.skip("the kernel's row sum matches no torch.sum here")
    if not one_call:
        kernel._lib = dataclasses.replace(kernel._lib, sum_width=None)
    for p1, p2 in ((0.95, 0.7), (0.6, 0.2), (1.5, 0.7), (0.99, 0.99), (0.7, 0.95)):
        for budget in (None, 0, 5, n_mid // 20 * hkv, n_mid * hkv):
            kw = dict(p1=p1, p2=p2, budget=budget, groups=t, pad=3, fallback=fallback)
            _same(kernel.pick(mass, **kw), doublep_select_ref(mass, sizes, starts, nonempty, perm, **kw))
    kw = dict(p1=0.95, p2=0.7, budget=None, groups=t, pad=3, fallback=fallback, exact_all=True)
    _same(kernel.pick(mass, **kw), doublep_select_ref(mass, sizes, starts, nonempty, perm, **kw))


@pytest.mark.parametrize("n", [*range(1, 40), 63, 64, 65, 255, 256, 257, 511, 1000, 4095, 4096, 4097, 16385, 70001])
def test_the_kernels_row_sum_is_torchs(n: int) -> None:
    """The one-call form's totals: ``kvstash_dp_torch_sum`` == ``torch.sum`` of float64 rows, bit for bit."""
    loaded = ops._load()
    assert loaded is not None
    if loaded.sum_width is None:
        pytest.skip("the kernel's row sum matches no torch.sum here")
    gen = torch.Generator().manual_seed(n)
    x = torch.softmax(torch.randn(3, n, generator=gen, dtype=torch.float64) * 6, -1).sort(-1, descending=True).values
    x = x.contiguous()
    fn = ops._torch_sum()
    assert [fn(x[i].data_ptr(), n, loaded.sum_width) for i in range(3)] == x.sum(-1).tolist()


def test_kernel_rejects_bad_input() -> None:
    mass, sizes, starts, nonempty, perm = _case(0, 1, 2, 16, 64, False)
    with pytest.raises(ValueError):
        doublep_select(mass, sizes.int(), starts, nonempty, perm, p1=0.9, p2=0.5, budget=None, groups=1, pad=0,
                       fallback=True)
    with pytest.raises(ValueError):
        doublep_select(mass.double(), sizes, starts, nonempty, perm, p1=0.9, p2=0.5, budget=None, groups=1, pad=0,
                       fallback=True)
