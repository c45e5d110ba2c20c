"""The CPU φ-term kernel (``workers/kernels/phi_term``) against its torch references, float32.

Tolerances: the kernel sums in another order than torch's matmuls, its exp is Cephes' polynomial (about 1 ulp)
against SLEEF's, and the GELU's erf is the formula torch's vectorized GELU uses. The MLP's outputs (|log φ| up to
about 10 here) agree to 2e-5 absolute + 1e-5 relative; the term's log Ẑ and mean to 1e-4 relative + 1e-5
absolute (they go through a log, an exp and a softmax over the features of up to a hundred summed entries). A
mistake (a term missed, a row or head mixed up) moves them by 1e-2 or more here.
"""

from __future__ import annotations

import pytest
import torch

from workers.kernels import phi_term as kernel
from workers.kernels.phi_term.stable_cache import U_FLOOR, stable_cache
from workers.methods import phi_maps

pytestmark = pytest.mark.skipif(not kernel.cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(h: int, d: int, e: int, f: int, seed: int = 0) -> list[torch.Tensor]:
    g = _gen(seed)

    def w(*shape: int) -> torch.Tensor:  # matrices scaled by 1/sqrt(fan-in), biases by 0.3
        scale = shape[-2] ** -0.5 if len(shape) > 2 else 0.3
        return torch.randn(*shape, generator=g) * scale

    return [w(h, d, e), w(h, e), w(h, e, e), w(h, e), w(h, e, e), w(h, e), torch.rand(h, generator=g),
            w(h, e, f), w(h, f)]


@pytest.mark.parametrize(("lead", "h", "n", "d", "e", "f"), [
    ((1,), 2, 40, 64, 64, 16),  # the shipped model's keys
    ((1,), 8, 1, 64, 64, 16),  # its queries: one row per query head
    ((2, 3), 2, 5, 64, 64, 16),  # leading dims, a partial block of rows
    ((1,), 2, 0, 64, 64, 16),  # no rows
    ((1,), 3, 7, 16, 32, 32),
    ((1,), 2, 9, 16, 24, 12),  # sizes off the 16-lane blocks: the row-by-row path
])
def test_mlp_matches_torch(lead: tuple[int, ...], h: int, n: int, d: int, e: int, f: int) -> None:
    weights = _weights(h, d, e, f)
    x = torch.randn(*lead, h, n, d, generator=_gen(1)) * 2
    got = kernel.phi_mlp(kernel.MlpLayer(weights), x)
    want = kernel.phi_mlp_ref(weights, x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("e", "f"), [(64, 16), (24, 12)])
def test_mlp_rows_do_not_depend_on_their_neighbours(e: int, f: int) -> None:
    layer = kernel.MlpLayer(_weights(2, 64, e, f))
    x = torch.randn(1, 2, 11, 64, generator=_gen(2))
    full = kernel.phi_mlp(layer, x)
    for lo, hi in ((0, 1), (3, 8), (5, 11)):
        assert torch.equal(kernel.phi_mlp(layer, x[:, :, lo:hi]), full[:, :, lo:hi])


def test_the_map_uses_the_kernel_without_autograd_and_torch_with_it() -> None:
    fmap = phi_maps.ReZeroMLPFeatureMap(n_layers=2, n_heads=8, n_kv_heads=2, head_dim=64, phi_dim=16)
    with torch.no_grad():
        fmap.k.alpha.fill_(0.5)
    k = torch.randn(1, 2, 10, 64, generator=_gen(3))
    with torch.no_grad():
        fast = fmap.log_phi_k(1, k)
    slow = fmap.log_phi_k(1, k)  # parameters require grad: torch ops, differentiable
    assert slow.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=2e-5)


def _case(t: int, h: int, n: int, g: int, d: int, f: int, seed: int):
    gen = _gen(seed)
    n_all = 300
    lp_all = torch.randn(h, n_all, f, generator=gen) * 3
    v_all = torch.randn(h, n_all, d, generator=gen)
    cache = stable_cache(lp_all, v_all)
    rows = torch.stack([torch.stack([torch.randperm(n_all, generator=gen)[:n] for _ in range(h)]) for _ in range(t)])
    valid = torch.rand(t, h, n, generator=gen) < 0.8
    lpq = torch.randn(t, h, g, f, generator=gen) * 2
    return lp_all, v_all, cache, rows, valid, lpq


@pytest.mark.parametrize(("t", "h", "n", "g", "d", "f"), [
    (1, 2, 160, 4, 64, 16),  # the shipped model at 4k
    (3, 2, 33, 4, 64, 16),  # rows of a query chunk
    (1, 1, 1, 1, 8, 4),
    (2, 3, 17, 2, 16, 12),
])
@pytest.mark.parametrize("mode", ["features", "table", "pools"])
def test_term_matches_torch(t: int, h: int, n: int, g: int, d: int, f: int, mode: str) -> None:
    lp_all, v_all, cache, rows, valid, lpq = _case(t, h, n, g, d, f, seed=4)
    heads = torch.arange(h).unsqueeze(-1)
    lp, v = lp_all[heads, rows], v_all[heads, rows]  # [T, H, n, F], [T, H, n, D]
    w = torch.exp(lp - cache.m.unsqueeze(-2)).masked_fill(~valid.unsqueeze(-1), 0.0)
    counts = valid.sum(-1)
    n_mid = int(counts.max())  # the fullest (t, h) has nothing left: -inf there
    want = kernel.phi_term_ref(w, v, cache.m, cache.u, cache.t, lpq, counts, n_mid)
    common = {"rel_tol": 64 * torch.finfo(torch.float32).eps, "u_floor": U_FLOOR}
    v8 = valid.view(torch.uint8)
    if mode == "features":
        got = kernel.phi_term(v, v.stride()[:3], None, v8, None, n_mid, cache.m, cache.u, cache.t, lpq,
                              lp.contiguous(), shape=(t, h, n), **common)
    else:
        # keys are the features' stand-ins here: pack copies rows, the test maps them with the identity
        keys = lp_all if mode == "pools" else lp.contiguous()
        vals = v_all if mode == "pools" else v
        r = rows if mode == "pools" else None
        ks = (0, keys.stride(0), keys.stride(1)) if mode == "pools" else keys.stride()[:3]
        vs = (0, vals.stride(0), vals.stride(1)) if mode == "pools" else vals.stride()[:3]
        table = torch.full((h, 301, f), float("nan"))
        have = torch.zeros(h, 301, dtype=torch.uint8)
        seen = rows[0, :, : n // 2]  # half of the first row's tokens were mapped by an earlier step
        table[heads, seen] = torch.exp(lp_all[heads, seen] - cache.m.unsqueeze(-2))
        have[heads, seen] = 1
        idx, packed = kernel.phi_pack(keys, ks, r, v8, None, rows, have, (t, h, n))
        fresh = valid & ~have.bool()[heads, rows]
        assert torch.equal(idx >= 0, fresh) and packed.shape[2] == int(fresh.sum(-1).max())
        got = kernel.phi_term(vals, vs, r, v8, None, n_mid, cache.m, cache.u, cache.t, lpq, packed.contiguous(),
                              shape=(t, h, n), idx=idx, tokens=rows, table=table, have=have, **common)
        assert bool(have.bool()[heads, rows][valid].all())  # every valid entry's features are kept now
        torch.testing.assert_close(table[heads, rows][valid], torch.exp(lp - cache.m.unsqueeze(-2))[valid],
                                   rtol=1e-5, atol=0.0)
    assert torch.isinf(got[0]).any() and torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_term_counts_instead_of_a_mask_and_everything_subtracted() -> None:
    h, n, g, d, f = 2, 12, 4, 16, 8
    gen = _gen(5)
    lp = torch.randn(1, h, n, f, generator=gen)
    v = torch.randn(1, h, n, d, generator=gen)
    cache = stable_cache(lp[0], v[0])
    lpq = torch.randn(1, h, g, f, generator=gen)
    counts = torch.tensor([[n, 5]])
    valid = torch.arange(n) < counts.unsqueeze(-1)
    w = torch.exp(lp - cache.m.unsqueeze(-2)).masked_fill(~valid.unsqueeze(-1), 0.0)
    want = kernel.phi_term_ref(w, v, cache.m, cache.u, cache.t, lpq, counts, n)
    got = kernel.phi_term(v, v.stride()[:3], None, None, counts, n, cache.m, cache.u, cache.t, lpq, lp,
                          shape=(1, h, n), rel_tol=64 * torch.finfo(torch.float32).eps, u_floor=U_FLOOR)
    assert torch.isneginf(got[0][0, 0]).all() and torch.isfinite(got[0][0, 1]).all()
    assert torch.isfinite(got[1]).all()  # head 0 has every feature at U_FLOOR and T_R = 0: mean 0, no NaN
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_completion_on_the_kernel_matches_its_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PhiCompletion.term`` end to end: the kernel (features cached across steps, K/V read from the pools; the whole
    step in one call, ``phi_step``) against the torch ops it replaces (no kernel anywhere, the map included), and
    bit for bit against the kernel's separate calls."""
    from workers.methods.layer_kv import ResidentKV
    from workers.methods.memory import MemorySource
    from workers.methods.phi import PhiCompletion, PhiSummarizer
    from workers.methods.selector import LayerContext

    hkv, g, n_tok, d, lo, hi = 2, 4, 600, 64, 4, 580

    def fmap() -> phi_maps.ReZeroMLPFeatureMap:
        m = phi_maps.ReZeroMLPFeatureMap(n_layers=1, n_heads=hkv * g, n_kv_heads=hkv, head_dim=d, phi_dim=16)
        with torch.no_grad():
            m.q.alpha.fill_(0.5)
            m.k.alpha.fill_(0.5)
        return m.requires_grad_(False)

    k, v = torch.randn(hkv, n_tok, d, generator=_gen(6)), torch.randn(hkv, n_tok, d, generator=_gen(7))

    def completion(m: phi_maps.ReZeroMLPFeatureMap) -> tuple[PhiCompletion, LayerContext]:
        class Phi(PhiSummarizer):
            def feature_map(self, head_dim: int) -> phi_maps.FeatureMap:
                return m

        comp = PhiCompletion(MemorySource.build([(k, v)], [Phi]), m)
        ctx = LayerContext(ResidentKV(k, v, page_size=16), lo, hi)
        comp.prepare(0, ctx)
        return comp, ctx

    fast, ctx = completion(fmap())
    with monkeypatch.context() as mp:
        mp.setattr("workers.methods.phi_maps.cpu_kernel_available", lambda: False)
        mp.setattr("workers.methods.phi.cpu_kernel_available", lambda: False)
        slow, _ = completion(fmap())
        slow_steps = []
        gen = _gen(8)
        steps = [(torch.randint(lo - 4, hi + 4, (1, hkv, 96), generator=gen), torch.randn(1, hkv, g, d, generator=gen))
                 for _ in range(4)]
        for tokens, q in steps:
            valid = (tokens >= lo) & (tokens < hi)
            tok = tokens.clamp(lo, hi - 1)
            heads = torch.arange(hkv).unsqueeze(-1)
            slow_steps.append(slow.term(0, ctx, q, d ** -0.5, k[heads, tok[0]][None], v[heads, tok[0]][None],
                                        valid.sum(-1), valid=valid, tokens=tok))
    split, _ = completion(fmap())  # the kernel in separate calls (phi_pack, the map's phi_mlp, phi_term)
    split.fmap.kernel_layers = lambda layer: None  # type: ignore[method-assign]
    assert fast.reads_pools(k, v) and 0 in fast._features and fast.fmap.kernel_layers(0) is not None
    for (tokens, q), want in zip(steps, slow_steps):
        valid = (tokens >= lo) & (tokens < hi)
        tok = tokens.clamp(lo, hi - 1)
        got = fast.term(0, ctx, q, d ** -0.5, k, v, valid.sum(-1), valid=valid, tokens=tok, rows=tok)
        parts = split.term(0, ctx, q, d ** -0.5, k, v, valid.sum(-1), valid=valid, tokens=tok, rows=tok)
        assert torch.equal(got[0], parts[0]) and torch.equal(got[1], parts[1])  # phi_step: the same bits
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
