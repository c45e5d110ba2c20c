"""φ completion's per-token features on the CPU (``phi_features``): steps that reuse the features of tokens
attended before give the bits of mapping every attended key each step, and each token is mapped once."""

from __future__ import annotations

import pytest
import torch

from workers.methods import phi_features
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.phi import PhiCompletion, PhiSummarizer
from workers.methods.phi_maps import FavorFeatureMap, FeatureMap, ReZeroMLPFeatureMap
from workers.methods.selector import LayerContext

HKV, G, N, D, PAGE, LO, HI = 2, 4, 400, 16, 16, 8, 380


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp_map() -> ReZeroMLPFeatureMap:
    fmap = ReZeroMLPFeatureMap(n_layers=1, n_heads=HKV * G, n_kv_heads=HKV, head_dim=D, phi_dim=12)
    with torch.no_grad():  # a non-trivial block (ReZero starts it at 0)
        fmap.q.alpha.fill_(0.5)
        fmap.k.alpha.fill_(0.5)
    return fmap.requires_grad_(False)


def _completion(fmap: FeatureMap) -> tuple[PhiCompletion, LayerContext, torch.Tensor, torch.Tensor]:
    k, v = torch.randn(HKV, N, D, generator=_gen(1)), torch.randn(HKV, N, D, generator=_gen(2))

    class Phi(PhiSummarizer):
        def feature_map(self, head_dim: int) -> FeatureMap:
            return fmap

    comp = PhiCompletion(MemorySource.build([(k, v)], [Phi]), fmap)
    ctx = LayerContext(ResidentKV(k, v, page_size=PAGE), LO, HI)
    comp.prepare(0, ctx)
    return comp, ctx, k, v


def _steps(n_steps: int, n_pages: int) -> list[torch.Tensor]:
    """Picked pages ``[1, Hkv, n_pages]`` per step, overlapping from step to step (boundary pages included)."""
    g = _gen(3)
    pages = torch.stack([torch.randperm(N // PAGE, generator=g)[:n_pages] for _ in range(HKV)])
    steps = []
    for _ in range(n_steps):
        steps.append(pages[None].sort(-1).values)
        fresh = torch.randint(N // PAGE, (HKV, 2), generator=g)
        pages = torch.cat([pages[:, 2:], fresh], 1)  # duplicates are fine: a page's features are the same
    return steps


@pytest.mark.parametrize("fmap", [_mlp_map(), FavorFeatureMap(12, seed=4)], ids=["rezero-mlp", "favor"])
def test_reused_features_give_the_bits_of_mapping_every_step(fmap: FeatureMap) -> None:
    comp, ctx, k, v = _completion(fmap)
    ref, _, _, _ = _completion(fmap)
    ref._features.clear()  # the reference maps every attended key every step
    assert 0 in comp._features
    seen: set[tuple[int, int]] = set()
    for i, pages in enumerate(_steps(6, 5)):
        tokens = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten(-2)  # [1, Hkv, n]
        valid = (tokens >= LO) & (tokens < HI)
        tokens = tokens.clamp(LO, HI - 1)  # as page entries hand them over: out-of-mid entries are masked
        rows = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten(-2).clamp_max(N - 1)
        k_sel = k.gather(1, rows[0].unsqueeze(-1).expand(-1, -1, D))[None]
        v_sel = v.gather(1, rows[0].unsqueeze(-1).expand(-1, -1, D))[None]
        q = torch.randn(1, HKV, G, D, generator=_gen(10 + i))
        counts = valid.sum(-1)
        got = comp.term(0, ctx, q, D ** -0.5, k_sel, v_sel, counts, valid=valid, tokens=tokens)
        want = ref.term(0, ctx, q, D ** -0.5, k_sel, v_sel, counts, valid=valid)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        seen |= {(h, int(t)) for h in range(HKV) for t, ok in zip(tokens[0, h], valid[0, h]) if ok}
    assert int(comp._features[0].have[:, :N].sum()) == len(seen)  # every attended mid token mapped, nothing else


def test_a_token_attended_again_is_not_mapped_again() -> None:
    comp, ctx, k, v = _completion(_mlp_map())
    calls: list[int] = []
    log_phi_k = comp.fmap.log_phi_k

    def counted(layer: int, keys: torch.Tensor) -> torch.Tensor:
        calls.append(keys.shape[-2])
        return log_phi_k(layer, keys)

    comp.fmap.log_phi_k = counted  # type: ignore[method-assign]
    tokens = torch.arange(LO, LO + 32).expand(1, HKV, -1)
    kv = k[None, :, LO:LO + 32], v[None, :, LO:LO + 32]
    counts = torch.full((1, HKV), 32)
    q = torch.randn(1, HKV, G, D, generator=_gen(5))
    first = comp.term(0, ctx, q, 1.0, *kv, counts, tokens=tokens)
    again = comp.term(0, ctx, q, 1.0, *kv, counts, tokens=tokens)
    assert calls == [32] and torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    wider = torch.arange(LO + 16, LO + 48).expand(1, HKV, -1)  # half of it new: only that half is mapped
    comp.term(0, ctx, q, 1.0, k[None, :, LO + 16:LO + 48], v[None, :, LO + 16:LO + 48], counts, tokens=wider)
    assert calls == [32, 16]


def test_features_stay_within_their_byte_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    layer_bytes = HKV * (N + 1) * 12 * 4  # float32 features of every token and the spare row
    monkeypatch.setattr("workers.methods.phi.CPU_PHI_FEATURE_BYTES", layer_bytes - 1)
    comp, _, _, _ = _completion(_mlp_map())
    assert not comp._features
    monkeypatch.setattr("workers.methods.phi.CPU_PHI_FEATURE_BYTES", layer_bytes)
    comp, _, _, _ = _completion(_mlp_map())
    assert comp._features[0].nbytes == layer_bytes < phi_features.CPU_PHI_FEATURE_BYTES
