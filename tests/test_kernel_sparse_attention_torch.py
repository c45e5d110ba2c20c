"""The float32 torch path of sparse decode attention (the CPU decode path) == the float64 reference.

Tolerances (``|torch - ref| <= atol + rtol * |ref|``, reference in float64 from the same inputs):
- float32 inputs: out atol 1e-5, rtol 1e-5; lse atol 1e-5 (fp32 arithmetic, summation order differs).
- bfloat16 inputs: out atol 1e-2, rtol 1e-2 (computed in fp32 from the bf16 inputs, then out is
  rounded to bf16: half an ulp is 2^-9 relative); lse atol 1e-4.
Unselected K/V rows, padding indices (far out of range) and padding bias are poisoned (NaN, huge
ids), so a path that reads them fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.kernels.sparse_attention import sparse_decode_attention_ref, sparse_decode_attention_torch

TOL = {torch.float32: (1e-5, 1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2, 1e-4)}
MODES = ("dense", "idx", "idx+nvalid", "idx+nvalid+bias", "pseudo", "all")


def make_case(seed: int, b: int, hkv: int, g: int, d: int, s: int, n: int, dtype: torch.dtype, mode: str,
              m: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Random inputs of one case: (q, k, v, kwargs); rows no valid entry selects are NaN."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    kw: dict = {}
    if "idx" in mode or mode == "all":
        idx = torch.stack([torch.randperm(s, generator=gen)[:n] for _ in range(b * hkv)]).view(b, hkv, n)
        kw["idx"] = idx.to(torch.int32 if seed % 2 else torch.int64)
    nv = torch.full((b, hkv), n)
    if "nvalid" in mode or mode == "all":
        nv = torch.randint(0, n + 1, (b, hkv), generator=gen, dtype=torch.int32)
        nv.view(-1)[0] = n
        nv.view(-1)[-1] = 0 if b * hkv > 1 else n  # an empty head
        kw["n_valid"] = nv
        pad = torch.arange(n).view(1, 1, n) >= nv.unsqueeze(-1)
        kw["idx"] = kw["idx"].masked_fill(pad, 10**9)
    if "bias" in mode or mode == "all":
        bias = torch.randn(b, hkv, n, generator=gen).abs().log1p()
        bias[..., 0] = float("-inf")
        kw["bias"] = bias.masked_fill(torch.arange(n).view(1, 1, n) >= nv.unsqueeze(-1), float("nan"))
    if "pseudo" in mode or mode == "all":
        pl = torch.randn(b, hkv * g, m, generator=gen) + 1.0
        pl[0, 0, 0] = float("-inf")
        kw["pseudo_logits"] = pl
        kw["pseudo_values"] = torch.randn(b, hkv * g, m, d, generator=gen).to(dtype)
    if "idx" in kw:
        sel = torch.zeros(b, hkv, s, dtype=torch.bool)
        for i in range(b):
            for h in range(hkv):
                sel[i, h, kw["idx"][i, h, : int(nv[i, h])].long()] = True
        k = k.masked_fill(~sel.unsqueeze(-1), float("nan"))
        v = v.masked_fill(~sel.unsqueeze(-1), float("nan"))
    return q, k, v, kw


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict, dtype: torch.dtype) -> None:
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = sparse_decode_attention_torch(q, k, v, scale=scale, **kw)
    ref_out, ref_lse = sparse_decode_attention_ref(q, k, v, scale=scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    atol, rtol, lse_atol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=lse_atol, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("b", [1, 3])
def test_matches_reference(dtype: torch.dtype, mode: str, g: int, b: int) -> None:
    q, k, v, kw = make_case(3 + g + b, b=b, hkv=2, g=g, d=64, s=300, n=97, dtype=dtype, mode=mode)
    check(q, k, v, kw, dtype)


def test_buffer_broadcast_over_rows_is_not_copied() -> None:
    """Rows sharing one buffer (the decode path's view of a page pool) give each row's own answer."""
    q, k, v, kw = make_case(11, b=5, hkv=2, g=4, d=32, s=200, n=40, dtype=torch.float32, mode="all")
    gen = torch.Generator().manual_seed(12)
    kb, vb = (torch.randn(1, 2, 200, 32, generator=gen).expand(5, -1, -1, -1) for _ in range(2))
    kw["idx"] = kw["idx"].clamp_max(199)
    kw["n_valid"] = torch.full((5, 2), 40)
    kw["bias"] = kw["bias"].nan_to_num(nan=0.5)  # every entry is valid now
    out, lse = sparse_decode_attention_torch(q, kb, vb, scale=0.2, **kw)
    ref_out, ref_lse = sparse_decode_attention_ref(q, kb.contiguous(), vb.contiguous(), scale=0.2, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)


def test_nothing_attended_is_zero_and_neg_inf() -> None:
    q = torch.randn(2, 4, 16)
    k = v = torch.randn(2, 2, 8, 16)
    idx = torch.zeros(2, 2, 5, dtype=torch.long)
    out, lse = sparse_decode_attention_torch(q, k, v, scale=0.25, idx=idx, n_valid=torch.zeros(2, 2))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("b", [1, 3])
def test_rows_shared_by_heads_equal_a_copied_buffer(b: int) -> None:
    """A page-cache pool (``[Hkv, S, D]`` with a zero head stride, broadcast over rows) gives bit for bit what the
    same rows copied out per head give: its one-pool row gather is not the per-head path's result by accident."""
    q, _, _, kw = make_case(21 + b, b=b, hkv=2, g=4, d=32, s=200, n=40, dtype=torch.float32, mode="all")
    gen = torch.Generator().manual_seed(22)
    kp, vp = (torch.randn(200, 32, generator=gen) for _ in range(2))
    kb, vb = (p.expand(b, 2, -1, -1) for p in (kp, vp))
    assert kb.stride()[:2] == (0, 0)
    kw["idx"] = torch.where(kw["idx"] < 200, kw["idx"], 10**9)  # padding stays poisoned
    out, lse = sparse_decode_attention_torch(q, kb, vb, scale=0.2, **kw)
    ref = sparse_decode_attention_torch(q, kb.contiguous(), vb.contiguous(), scale=0.2, **kw)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    ref_out, _ = sparse_decode_attention_ref(q, kb.contiguous(), vb.contiguous(), scale=0.2, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b", [1, 3])
def test_padding_masked_past_the_shortest_row(b: int) -> None:
    """Every row has some valid entries (the CPU path masks only from the shortest row's count on): padding ids
    still point at poisoned (NaN) rows and get a NaN bias, and none of it reaches the answer."""
    gen = torch.Generator().manual_seed(40 + b)
    hkv, g, d, s, n = 2, 4, 32, 300, 97
    q = torch.randn(b, hkv * g, d, generator=gen)
    k, v = torch.randn(b, hkv, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen)
    idx = torch.stack([torch.randperm(s, generator=gen)[:n] for _ in range(b * hkv)]).view(b, hkv, n)
    nv = torch.randint(n // 2, n + 1, (b, hkv), generator=gen)
    nv.view(-1)[0] = n // 2
    pad = torch.arange(n) >= nv.unsqueeze(-1)
    sel = torch.zeros(b, hkv, s, dtype=torch.bool).scatter_(2, idx, ~pad)  # rows only padding points at: NaN
    k, v = (x.masked_fill(~sel.unsqueeze(-1), float("nan")) for x in (k, v))
    bias = torch.randn(b, hkv, n, generator=gen).masked_fill(pad, float("nan"))
    kw = {"idx": idx, "n_valid": nv, "bias": bias}
    out, lse = sparse_decode_attention_torch(q, k, v, scale=0.2, **kw)
    ref_out, ref_lse = sparse_decode_attention_ref(q, k, v, scale=0.2, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)
