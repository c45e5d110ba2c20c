"""Dense attention with log-sum-exp (fused kernels) == its fp32 matmul reference.

Cases: shapes (decode L=1, a query's first forward, a causal block over its own cache), GQA
ratios 1, 4 and 8, float32 and bfloat16 inputs, no mask / causal at offset 0 / causal at an
offset / an offset past every key. CPU cases run the CPU flash kernel; CUDA cases (flash for
bf16, memory-efficient attention for fp32) skip where there is no GPU.

Tolerances (``|op - ref| <= atol + rtol * |ref|``; the reference computes in fp32 from the same
inputs, so bf16 cases differ by the kernel's rounding of probabilities and output to bf16):
- float32: out atol 2e-5, rtol 1e-4; lse atol 2e-5.
- bfloat16: out atol 2e-2, rtol 2e-2; lse atol 2e-3 (bf16 q . k products, fp32 accumulation).
"""

from __future__ import annotations

import pytest
import torch

from workers.kernels.dense_attention import causal_attention, dense_attention, dense_attention_ref

TOL = {torch.float32: (2e-5, 1e-4, 2e-5), torch.bfloat16: (2e-2, 2e-2, 2e-3)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
SHAPES = [  # (B, Hkv, L, S, D)
    (1, 2, 1, 4055, 64),
    (2, 2, 37, 700, 64),
    (1, 1, 5, 129, 128),
]
MASKS = ("none", "causal0", "offset", "sees_all")


def _case(seed: int, b: int, hkv: int, g: int, l: int, s: int, d: int, dtype: torch.dtype, device: str
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, l, d, generator=gen) * 2
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _offset(mask: str, l: int, s: int) -> int | None:
    return {"none": None, "causal0": 0, "offset": max(0, s - l), "sees_all": s + 3}[mask]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_matches_reference(device: str, dtype: torch.dtype, g: int, shape: tuple[int, ...], mask: str) -> None:
    b, hkv, l, s, d = shape
    if mask == "causal0":
        s = l  # a block attending itself causally
    q, k, v = _case(hash((g, shape)) % 1000, b, hkv, g, l, s, d, dtype, device)
    off = _offset(mask, l, s)
    scale = d**-0.5
    out, lse = dense_attention(q, k, v, scale, off)
    ref_out, ref_lse = dense_attention_ref(q, k, v, scale, off)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    atol, rtol, lse_atol = TOL[dtype]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=lse_atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_query_and_broadcast_batch(device: str) -> None:
    """A query in transformers' layout (a transposed view) and K/V as a ``[None]`` view of a layer."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 8, 64, generator=gen).to(device).transpose(1, 2)  # [B, Hq=8, L=3, D]
    k, v = (torch.randn(2, 500, 64, generator=gen).to(device)[None] for _ in range(2))
    out, lse = dense_attention(q, k, v, 0.125)
    ref_out, ref_lse = dense_attention_ref(q, k, v, 0.125)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)


def test_rows_that_see_nothing_fall_back_to_the_reference() -> None:
    q, k, v = _case(1, 1, 2, 2, 3, 10, 16, torch.float32, "cpu")
    out, lse = dense_attention(q, k, v, 0.25, q_offset=-2)
    assert torch.isneginf(lse[..., :2]).all() and torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :]))
    torch.testing.assert_close(lse[..., 2], dense_attention_ref(q, k, v, 0.25, q_offset=-2)[1][..., 2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("l", "s", "g"), [(7, 7, 4), (5, 40, 4), (33, 100, 1), (1, 64, 8)])
def test_causal_attention_is_the_last_rows_of_a_causal_block(device: str, dtype: torch.dtype, l: int, s: int,
                                                             g: int) -> None:
    """A prefill chunk of L queries over S cached keys: query i sees keys j <= S - L + i, output in q's dtype."""
    q, k, v = _case(l + s, 1, 2, g, l, s, 64, dtype, device)
    out = causal_attention(q, k, v, 0.125)
    ref, _ = dense_attention_ref(q, k, v, 0.125, q_offset=s - l)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol, _ = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
