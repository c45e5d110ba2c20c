"""Quest page upper-bound kernel == its torch reference, and the reference == ``QuestSelector``'s torch path.

The Triton kernel runs in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU)
or on CUDA. Outputs are pre-filled with NaN (``torch.empty`` poisoned), so an unwritten logit fails.

Tolerances (``|kernel - ref| <= atol + rtol * |ref|``):
- float32 bounds and q: atol 2e-5, rtol 1e-5 (both sum float32 products, in different orders).
- bf16 bounds and q: atol 1e-5, rtol 2^-7. The kernel sums exact bf16 x bf16 products in float32; the
  reference (the selector's former torch path) rounds its bf16 matmul to bf16, at most 2^-8 relative.
- The kernel against float64 sums of the same (dtype-cast) operands: atol 1e-4, rtol 1e-5 in every case
  (a missing or doubled product term is ~0.05 here).
"""

from __future__ import annotations

import os

import pytest
import torch

import workers.kernels.quest_scores.ops as qs_ops
from workers.kernels.quest_scores import (
    QuestScoresConfig,
    member_offsets,
    quest_upper_bounds,
    quest_upper_bounds_members,
    quest_upper_bounds_ref,
)
from workers.methods.quest import QuestSelector

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1e-5, 2.0**-7)}
EXACT_TOL = (1e-4, 1e-5)
SCALE = 0.125


def _case(t: int, hkv: int, g: int, d: int, u: int, dtype: torch.dtype, seed: int = 0,
          q_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hkv, G, D]`` and stacked bounds ``[Hkv, 2D, U]`` (kmax rows over kmin rows, kmin <= kmax)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hkv, g, d, generator=gen)
    a, b = torch.randn(2, hkv, u, d, generator=gen)
    kb = torch.cat([torch.maximum(a, b), torch.minimum(a, b)], dim=-1).transpose(1, 2).contiguous()
    return q.to(DEV, q_dtype or dtype), kb.to(DEV, dtype)


def _exact(q: torch.Tensor, kb: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 ``scale * (q⁺ . kmax + q⁻ . kmin)`` of q cast to the bounds' dtype (as both paths cast it)."""
    d = q.shape[-1]
    qc = q.to(kb.dtype).double()
    kmax, kmin = kb[:, :d].double(), kb[:, d:].double()
    return (torch.einsum("thgd,hdu->thgu", qc.clamp_min(0), kmax)
            + torch.einsum("thgd,hdu->thgu", qc.clamp_max(0), kmin)) * scale


def _assert_close(x: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    assert x.shape == ref.shape and x.dtype == torch.float32
    assert not x.isnan().any(), "unwritten (NaN) logits"
    err = (x.double() - ref.double()).abs() - rtol * ref.double().abs()
    assert err.max().item() <= atol, f"max excess error {err.max().item():.3g} over atol {atol}"


@pytest.fixture()
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs the launcher allocates start as NaN, so a logit the kernel does not write fails."""
    real = qs_ops._empty

    def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return real(*shape, dtype=dtype, device=device).fill_(float("nan"))

    monkeypatch.setattr(qs_ops, "_empty", empty)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("u", [1, 17, 300])
@pytest.mark.parametrize("g", [1, 4, 5])
@pytest.mark.parametrize("t,hkv,d", [(1, 1, 64), (3, 2, 128), (1, 8, 128), (3, 8, 64)])
def test_triton_equals_reference(t: int, hkv: int, g: int, d: int, u: int, dtype: torch.dtype) -> None:
    q, kb = _case(t, hkv, g, d, u, dtype, seed=t * 1000 + hkv * 100 + g * 10 + u)
    out = quest_upper_bounds(q, kb, SCALE, use_triton=True)
    _assert_close(out, quest_upper_bounds_ref(q, kb, SCALE), *TOL[dtype])
    _assert_close(out, _exact(q, kb, SCALE), *EXACT_TOL)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("config", [QuestScoresConfig(block_u=16, block_k=16, max_rows=16, num_warps=2),
                                    QuestScoresConfig(block_u=64, block_k=64, num_stages=1)],
                         ids=["small-blocks", "wide-k"])
@pytest.mark.parametrize("t,hkv,g,d,u", [(5, 2, 4, 64, 40), (2, 1, 3, 80, 33), (1, 3, 2, 8, 20)])
def test_row_blocks_and_odd_head_dims(config: QuestScoresConfig, t: int, hkv: int, g: int, d: int, u: int) -> None:
    """More rows than one program takes (split over programs), head dims that are no power of two."""
    q, kb = _case(t, hkv, g, d, u, torch.bfloat16, seed=d + u)
    out = quest_upper_bounds(q, kb, SCALE, use_triton=True, config=config)
    _assert_close(out, quest_upper_bounds_ref(q, kb, SCALE), *TOL[torch.bfloat16])
    _assert_close(out, _exact(q, kb, SCALE), *EXACT_TOL)


@needs_triton
@pytest.mark.parametrize("q_dtype,kb_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_strided_and_mixed_dtype_queries(q_dtype: torch.dtype, kb_dtype: torch.dtype) -> None:
    """q as a strided view ([T, G, Hkv, D] permuted, every other channel) in another dtype than the bounds."""
    t, hkv, g, d, u = 2, 2, 4, 64, 50
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(t, g, hkv, 2 * d, generator=gen).to(DEV, q_dtype)
    q = base[..., ::2].permute(0, 2, 1, 3)  # [T, Hkv, G, D], no unit stride anywhere
    assert not q.is_contiguous() and q.stride(-1) == 2
    _, kb = _case(t, hkv, g, d, u, kb_dtype, seed=8)
    out = quest_upper_bounds(q, kb, SCALE, use_triton=True)
    _assert_close(out, quest_upper_bounds_ref(q, kb, SCALE), *TOL[torch.bfloat16])
    _assert_close(out, _exact(q, kb, SCALE), *EXACT_TOL)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("p0,p1", [(7, 31), (0, 50), (49, 50), (13, 50)])
def test_a_page_range_of_the_stack_needs_no_copy(dtype: torch.dtype, p0: int, p1: int) -> None:
    """kb as a view of pages [p0, p1) of a wider stack (rows 50 apart, offset p0): the logits of those pages."""
    q, full = _case(3, 2, 4, 64, 50, dtype, seed=21)
    kb = full[..., p0:p1]
    assert kb.stride(1) == 50 and (p1 - p0 == 50 or not kb.is_contiguous())
    out = quest_upper_bounds(q, kb, SCALE, use_triton=True)
    _assert_close(out, quest_upper_bounds_ref(q, kb.contiguous(), SCALE), *TOL[dtype])
    _assert_close(out, _exact(q, kb, SCALE), *EXACT_TOL if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_bounds_bound_every_key_logit(use_triton: bool) -> None:
    """From keys: each page's upper bound is >= the logit of every key in it, and = for a one-key page."""
    gen = torch.Generator().manual_seed(3)
    hkv, g, d, page, pages = 2, 4, 64, 16, 9
    k = torch.randn(hkv, pages * page, d, generator=gen).to(DEV)
    k[:, -page + 1:] = k[:, -page:-page + 1]  # the last page holds one distinct key: its bound is exact
    q = torch.randn(1, hkv, g, d, generator=gen).to(DEV)
    kp = k.view(hkv, pages, page, d)
    kb = torch.cat([kp.amax(2), kp.amin(2)], dim=-1).transpose(1, 2).contiguous()
    ub = quest_upper_bounds(q, kb, SCALE, use_triton=use_triton)[0]  # [Hkv, G, pages]
    logits = torch.einsum("hgd,hpkd->hgpk", q[0], kp) * SCALE
    assert (logits.amax(-1) <= ub + 1e-5).all()
    torch.testing.assert_close(ub[..., -1], logits[..., -1, 0], atol=1e-5, rtol=1e-5)


def _selector(hkv: int, pages: int, d: int, dtype: torch.dtype, seed: int) -> QuestSelector:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, hkv, pages, d, generator=gen)
    return QuestSelector({"0.kmin": torch.minimum(a, b).to(DEV, dtype), "0.kmax": torch.maximum(a, b).to(DEV, dtype),
                          "0.meta": torch.tensor([16])})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_equals_selector_torch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Where the selector takes the torch path (CPU) its logits are the reference's, bit for bit."""
    if DEV.type != "cpu":
        pytest.skip("CUDA tensors always take the kernel")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sel = _selector(2, 40, 64, dtype, seed=5)
    q = torch.randn(3, 2, 4, 64, generator=torch.Generator().manual_seed(6))
    kb = torch.cat([sel.bounds["0.kmax"][:, 7:31], sel.bounds["0.kmin"][:, 7:31]], dim=-1).transpose(1, 2)
    assert torch.equal(sel.upper_bounds(0, q, SCALE, 7, 31), quest_upper_bounds_ref(q, kb.contiguous(), SCALE))
    # any other range is a view of the same stack (the layer's kmax/kmin are gone by now)
    assert "0.kmax" not in sel.bounds and "0.kmin" not in sel.bounds
    assert torch.equal(sel.upper_bounds(0, q, SCALE, 10, 20),
                       quest_upper_bounds_ref(q, kb[..., 3:13].contiguous(), SCALE))
    assert sel.upper_bounds(0, q, SCALE, 0, 40).shape[-1] == 40
    with pytest.raises(ValueError, match="outside the prefix's 40 pages"):
        sel.upper_bounds(0, q, SCALE, 5, 41)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_selector_upper_bounds_match_the_definition(dtype: torch.dtype) -> None:
    """The selector's logits (the kernel on CUDA, the torch reference on the CPU) = scale * (q⁺ . kmax + q⁻ . kmin)
    of the pages asked for, computed here from the bounds dict in float64."""
    sel = _selector(2, 40, 64, dtype, seed=9)
    q = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(10)).to(DEV)
    kmax, kmin = sel.bounds["0.kmax"][:, 5:33].double(), sel.bounds["0.kmin"][:, 5:33].double()
    ub = sel.upper_bounds(0, q, SCALE, 5, 33)
    qc = q.to(dtype).double()
    want = (torch.einsum("thgd,hud->thgu", qc.clamp_min(0), kmax)
            + torch.einsum("thgd,hud->thgu", qc.clamp_max(0), kmin)) * SCALE
    _assert_close(ub, want, *TOL[dtype])


def test_invalid_calls_say_how_to_fix_them() -> None:
    q, kb = _case(1, 2, 4, 64, 10, torch.float32)
    with pytest.raises(ValueError, match=r"q must be a float tensor \[T, Hkv, G, D\]"):
        quest_upper_bounds(q[0], kb, SCALE)
    with pytest.raises(ValueError, match="contiguous"):
        quest_upper_bounds(q, kb.transpose(1, 2).contiguous().transpose(1, 2), SCALE)
    with pytest.raises(ValueError, match=r"expected \[Hkv=2, 2D=128, U\]"):
        quest_upper_bounds(q, kb[:, :64].contiguous(), SCALE)
    with pytest.raises(ValueError, match="scale"):
        quest_upper_bounds(q, kb, torch.tensor(SCALE))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="power of two"):
        QuestScoresConfig(block_u=48)
    with pytest.raises(ValueError, match="num_warps"):
        QuestScoresConfig(num_warps=3)


def _members(m: int, hkv: int, g: int, d: int, u: int, dtype: torch.dtype, page_range: bool = False
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One query token per member and each member's own bounds (separate allocations; ``page_range``: a page
    range of a larger stack, as ``StackedBounds.get`` hands out)."""
    qs, kbs = [], []
    for i in range(m):
        q, kb = _case(1, hkv, g, d, u + (5 if page_range else 0), dtype, seed=i * 7 + u)
        qs.append(q)
        kbs.append(kb[..., 3:3 + u] if page_range else kb)
    return torch.cat(qs), kbs


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("u", [1, 17, pytest.param(300, marks=pytest.mark.slow)])  # 300: 4-5 s each, interpreted
@pytest.mark.parametrize("m,hkv,g,d", [(1, 2, 4, 64), (3, 2, 5, 64), (4, 8, 4, 128), (2, 1, 20, 32)])
@pytest.mark.parametrize("page_range", [False, True], ids=["whole", "range"])
def test_members_equal_each_members_own_launch(m: int, hkv: int, g: int, d: int, u: int, dtype: torch.dtype,
                                               page_range: bool) -> None:
    """Several members' rows in one launch give each member's one-member result exactly (the same kernel
    arithmetic over its own bounds), and match the reference within the stated tolerance."""
    q, kbs = _members(m, hkv, g, d, u, dtype, page_range)
    config = QuestScoresConfig(max_rows=16)  # G = 20 then takes two row blocks per member
    out = quest_upper_bounds_members(q, kbs, SCALE, use_triton=True, config=config)
    assert out.shape == (m, hkv, g, u)
    for i, kb in enumerate(kbs):
        alone = quest_upper_bounds(q[i:i + 1], kb, SCALE, use_triton=True, config=config)
        assert torch.equal(out[i:i + 1], alone), f"member {i} differs from its own launch"
        _assert_close(out[i:i + 1], quest_upper_bounds_ref(q[i:i + 1], kb, SCALE), *TOL[dtype])
    ref = quest_upper_bounds_members(q, kbs, SCALE, use_triton=False)
    _assert_close(out, ref, *TOL[dtype])


@needs_triton
def test_members_take_a_table_made_beforehand() -> None:
    """The offsets table made once (as a captured step makes it before capturing) gives the same scores; a
    table that points elsewhere gives other scores (the kernel does read it)."""
    q, kbs = _members(3, 2, 4, 64, 17, torch.float32)
    table = member_offsets(kbs)
    got = quest_upper_bounds_members(q, kbs, SCALE, offsets=table, use_triton=True)
    assert torch.equal(got, quest_upper_bounds_members(q, kbs, SCALE, use_triton=True))
    swapped = quest_upper_bounds_members(q, kbs, SCALE, offsets=table.flip(0), use_triton=True)
    assert not torch.equal(swapped[0], got[0])
    assert torch.equal(swapped[0], quest_upper_bounds(q[:1], kbs[2], SCALE, use_triton=True)[0])


def test_members_refuse_mismatched_bounds() -> None:
    q, kbs = _members(2, 2, 4, 64, 17, torch.float32)
    with pytest.raises(ValueError, match="share shape"):
        quest_upper_bounds_members(q, [kbs[0], kbs[1][..., :16]], SCALE, use_triton=False)
    with pytest.raises(ValueError, match="one member per bounds"):
        quest_upper_bounds_members(q, kbs[:1], SCALE, use_triton=False)
    with pytest.raises(ValueError, match="offsets"):
        quest_upper_bounds_members(q, kbs, SCALE, offsets=torch.zeros(3, dtype=torch.int64), use_triton=False)
