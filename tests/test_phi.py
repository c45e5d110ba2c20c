"""φ completion: the stable cache (appendix C) against naive float64 sums, one-way subtraction,
log-domain stability, the feature maps, and the merge under one normalization.

Tolerances: float64 paths agree to 1e-10 relative; the float32 cache to 1e-5 relative.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.attention import dense_attention
from workers.kernels.phi_term.stable_cache import evaluate, shifted_sums, stable_cache, subtract
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.phi import PhiCompletion, PhiSummarizer, build_cache
from workers.methods.phi_maps import FavorFeatureMap, FeatureMap, ReZeroMLPFeatureMap, favor_omega
from workers.methods.registry import get_method
from workers.methods.selector import LayerContext
from workers.requests import DecodeConfig


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def naive(log_phi_q: torch.Tensor, log_phi_k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log Z and N/Z by direct float64 sums over keys: z_i = <exp(lq), exp(lk_i)>."""
    lq, lk, v = log_phi_q.double(), log_phi_k.double(), v.double()
    log_z_i = torch.logsumexp(lq[:, None, :] + lk[None, :, :], dim=-1)  # [G, n]
    log_z = torch.logsumexp(log_z_i, dim=-1)
    return log_z, torch.softmax(log_z_i, dim=-1) @ v


def test_stable_cache_equals_natural_float64_sums() -> None:
    lk = torch.randn(3, 50, 8, generator=_gen(0), dtype=torch.float64) * 3
    v = torch.randn(3, 50, 5, generator=_gen(1), dtype=torch.float64)
    cache = stable_cache(lk, v)
    u_nat, s_nat = cache.natural()
    phi = lk.exp()
    torch.testing.assert_close(u_nat, phi.sum(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(s_nat, torch.einsum("hnf,hnd->hfd", phi, v), rtol=1e-12, atol=1e-12)
    assert (cache.u >= 1).all() and (cache.m == lk.amax(1)).all()  # the max element contributes exp(0)


def test_chunked_build_equals_one_pass() -> None:
    fmap = FavorFeatureMap(16, seed=3)
    k = torch.randn(2, 301, 8, generator=_gen(2))
    v = torch.randn(2, 301, 8, generator=_gen(3))
    one = stable_cache(fmap.log_phi_k(0, k), v)
    chunked = build_cache(fmap, 0, k, v, chunk=64)
    for a, b in zip((one.m, one.u, one.t), (chunked.m, chunked.u, chunked.t)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_subtraction_equals_recomputing_on_the_remainder(dtype: torch.dtype) -> None:
    n, f, d = 200, 12, 6
    lk = (torch.randn(n, f, generator=_gen(4)) * 2).to(dtype)
    v = torch.randn(n, d, generator=_gen(5)).to(dtype)
    lq = (torch.randn(3, f, generator=_gen(6)) * 2).to(dtype)
    picked = torch.randperm(n, generator=_gen(7))[:70]
    rest = torch.ones(n, dtype=torch.bool)
    rest[picked] = False
    cache = stable_cache(lk, v)
    u_r, t_r = subtract(cache, *shifted_sums(cache.m, lk[picked], v[picked]))
    u_direct, t_direct = shifted_sums(cache.m, lk[rest], v[rest])  # same shift, remainder only
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(u_r, u_direct, rtol=tol, atol=tol)
    torch.testing.assert_close(t_r, t_direct, rtol=tol, atol=tol)
    log_z, mean = evaluate(lq, cache.m, u_r, t_r)
    ref_log_z, ref_mean = naive(lq, lk[rest], v[rest])
    torch.testing.assert_close(log_z.double(), ref_log_z, rtol=tol, atol=tol)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=tol, atol=tol)


def test_subtracting_everything_leaves_no_mass_and_no_nan() -> None:
    lk = torch.randn(40, 8, generator=_gen(8)) * 4
    v = torch.randn(40, 4, generator=_gen(9))
    cache = stable_cache(lk, v)
    u_r, t_r = subtract(cache, *shifted_sums(cache.m, lk, v))
    assert (u_r > 0).all() and (t_r == 0).all()  # clamped to the floor, never negative
    log_z, mean = evaluate(torch.zeros(2, 8), cache.m, u_r, t_r)
    assert torch.isfinite(log_z).all() and (log_z < cache.m.max() - 50).all() and (mean == 0).all()


def test_large_logits_stay_finite_and_exact() -> None:
    """log φ of magnitude ~1e3 (exp overflows float64 at ~709): every step stays in the log domain."""
    lk = torch.randn(2, 300, 16, generator=_gen(10)) * 300 + 600
    v = torch.randn(2, 300, 8, generator=_gen(11))
    lq = torch.randn(2, 4, 16, generator=_gen(12)) * 300 + 500
    cache = stable_cache(lk, v)
    picked = torch.arange(0, 300, 3)
    u_r, t_r = subtract(cache, *shifted_sums(cache.m, lk[:, picked], v[:, picked]))
    log_z, mean = evaluate(lq, cache.m, u_r, t_r)
    assert torch.isfinite(log_z).all() and torch.isfinite(mean).all() and log_z.abs().max() > 1000
    keep = torch.ones(300, dtype=torch.bool)
    keep[picked] = False
    for h in range(2):
        ref_log_z, ref_mean = naive(lq[h], lk[h, keep], v[h, keep])
        torch.testing.assert_close(log_z[h].double(), ref_log_z, rtol=1e-5, atol=1e-2)
        torch.testing.assert_close(mean[h].double(), ref_mean, rtol=1e-3, atol=1e-3)


def test_favor_is_positive_seeded_and_unbiased() -> None:
    d, s = 8, 8 ** -0.5
    q = torch.randn(1, 1, 1, d, generator=_gen(13)) * 0.5  # [T, Hkv, G, D]
    k = torch.randn(1, 20, d, generator=_gen(14)) * 0.5
    exact = torch.exp(s * k[0] @ q[0, 0, 0])
    rel = []
    for seed in range(8):
        fmap = FavorFeatureMap(4096, seed=seed)
        est = torch.logsumexp(fmap.log_phi_q(0, q, s)[0, 0, 0][None] + fmap.log_phi_k(0, k)[0], dim=-1).exp()
        rel.append((est - exact) / exact)
    err = torch.stack(rel)
    assert err.abs().mean() < 0.05 and err.mean().abs() < 0.01  # Monte Carlo noise, and no bias
    again = FavorFeatureMap(4096, seed=1).log_phi_k(0, k)
    torch.testing.assert_close(again, FavorFeatureMap(4096, seed=1).log_phi_k(0, k), rtol=0, atol=0)
    assert not torch.equal(FavorFeatureMap(4096, seed=2).log_phi_k(0, k), again)
    assert again.shape == (1, 20, 4096) and torch.isfinite(again).all()


def test_favor_projections_are_drawn_once_per_process_and_differ_per_layer_and_head() -> None:
    """A new map (each prefill builds one) reuses the projections already drawn; layers and heads get their own."""
    favor_omega.cache_clear()
    first = FavorFeatureMap(16, seed=3).omega(1, 2, 8, torch.device("cpu"))
    assert favor_omega.cache_info().misses == 1
    again = FavorFeatureMap(16, seed=3).omega(1, 2, 8, torch.device("cpu"))
    assert favor_omega.cache_info().hits == 1 and torch.equal(first, again) and first.shape == (2, 16, 8)
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first, FavorFeatureMap(16, seed=3).omega(2, 2, 8, torch.device("cpu")))


def test_rezero_mlp_map_loads_weights() -> None:
    kw = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "phi_dim": 6}
    a, b = ReZeroMLPFeatureMap(seed=0, **kw), ReZeroMLPFeatureMap(seed=5, **kw)
    q, k = torch.randn(3, 2, 2, 8, generator=_gen(15)), torch.randn(2, 7, 8, generator=_gen(16))
    assert not torch.equal(a.log_phi_k(1, k), b.log_phi_k(1, k))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.log_phi_k(1, k), a.log_phi_k(1, k), rtol=0, atol=0)
    torch.testing.assert_close(b.log_phi_q(1, q, 1.0), a.log_phi_q(1, q, 1.0), rtol=0, atol=0)
    assert a.log_phi_q(0, q, 1.0).shape == (3, 2, 2, 6) and (a.q.alpha == 0).all()
    # query head h*G+g has its own MLP: permuting heads within a group changes its features
    assert not torch.equal(a.log_phi_q(0, q.flip(2), 1.0).flip(2), a.log_phi_q(0, q, 1.0))


class OneHotMap(FeatureMap):
    """An *exact* positive factorization for keys ``c e_j``: exp(s q . c e_j) = φq(q)[j] φk(c e_j)[j]."""

    kind = 99

    def __init__(self, dim: int, c: float):
        super().__init__()
        self.phi_dim, self.c = dim, c

    def log_phi_k(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        return torch.where(k.float() > 0, 0.0, float("-inf"))

    def log_phi_q(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        return q.float() * scale * self.c


class OneHotPhi(PhiSummarizer):
    def feature_map(self, head_dim: int) -> FeatureMap:
        return OneHotMap(head_dim, 3.0)


@pytest.mark.parametrize("method", ["topk+phi", "quest+phi", "doublep+phi"])
@pytest.mark.parametrize("fraction", [0.05, 0.2, None])
def test_exact_feature_map_makes_completion_exact(method: str, fraction: float | None) -> None:
    """With a map that factorizes exp(q.k) exactly, selection + completion equals full attention at
    any budget: the subtraction, the pseudo-entry and the single normalization are all exact."""
    hkv, n, d = 2, 400, 16
    k = torch.nn.functional.one_hot(torch.randint(d, (hkv, n), generator=_gen(17)), d).float() * 3.0
    v = torch.randn(hkv, n, d, generator=_gen(18))
    base = get_method(method)
    src = MemorySource.build([(k, v)], [*(s for s in base.summarizers if s.name != "phi"), OneHotPhi])
    # anchors and the φ fetch amortized over a long answer: a feasible plan at 5 % of this short prefix
    cfg = DecodeConfig(budget=fraction, sink=2, tail=4, gen_len=256)
    attn = type(base)(feature_map=OneHotMap(d, 3.0)).open(src, cfg)
    q = torch.randn(1, hkv * 2, 3, d, generator=_gen(19))
    out, lse = attn.attend(0, q, d ** -0.5)
    ref, ref_lse = dense_attention(q, k[None], v[None], d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    assert attn.read_report().tokens_per_step[0] < hkv * n  # it did not just read everything


def test_wider_anchors_are_subtracted_from_the_stored_cache() -> None:
    """Decode anchors wider than at prefill: the cache loses exactly those tokens."""
    hkv, n, d = 2, 120, 8
    k, v = torch.randn(hkv, n, d, generator=_gen(20)), torch.randn(hkv, n, d, generator=_gen(21))
    src = MemorySource.build([(k, v)], [PhiSummarizer])
    comp = PhiCompletion(src)
    ctx = LayerContext(ResidentKV(k, v, page_size=16), 10, n - 30)
    comp.prepare(0, ctx)
    direct = build_cache(comp.fmap, 0, k[:, 10:n - 30], v[:, 10:n - 30])
    q = torch.randn(1, hkv, 2, d, generator=_gen(22))
    empty = torch.zeros(1, hkv, 0, d)
    log_z, mean = comp.term(0, ctx, q, d ** -0.5, empty, empty, torch.zeros(1, hkv, dtype=torch.long))
    ref_log_z, ref_mean = evaluate(comp.fmap.log_phi_q(0, q, d ** -0.5), direct.m, direct.u, direct.t)
    torch.testing.assert_close(log_z, ref_log_z, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-4, atol=1e-4)
    assert math.isfinite(float(log_z.max()))
