"""RoPE and RMSNorm kernels == their torch references (transformers' Llama arithmetic), and the model routed
through them (``workers.model_ops``) gives the model's own outputs.

The kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU) or on CUDA.
Tolerances:
- RoPE: bit-equal (the kernel serves bf16, rounding each product and the sum to bf16 on the bits, in
  transformers' order; fp16 and float32 take the reference, transformers' formula itself).
- RMSNorm: 1 ulp of the dtype relative (rel 2^-7 bf16, 2^-10 fp16), fp32 rel 1e-6 (the sum of squares is
  reduced in another order than torch's mean, and the kernel divides by a square root where torch uses rsqrt).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.llama import modeling_llama

from workers import model_ops
from workers.kernels.rms_norm import rms_norm, rms_norm_ref
from workers.kernels.rope import apply_rope, apply_rope_ref
from workers.model import load_model

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
HF_ROPE = model_ops._HF_ROPE  # transformers' own (kept by model_ops before any model routes it)
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}


def _rope_case(b: int, hq: int, hkv: int, t: int, d: int, dtype: torch.dtype, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k laid out as transformers makes them ([B, T, H, D] projections, transposed) and cos, sin ``[B, T, D]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=gen).to(DEV, dtype).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=gen).to(DEV, dtype).transpose(1, 2)
    ang = torch.rand(b, t, d // 2, generator=gen) * 50
    emb = torch.cat([ang, ang], dim=-1)
    return q, k, emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("b,hq,hkv,t,d", [(1, 4, 2, 1, 16), (2, 8, 2, 5, 64), (1, 32, 8, 3, 128), (1, 6, 3, 17, 80)])
def test_rope_kernel_equals_transformers(b: int, hq: int, hkv: int, t: int, d: int, dtype: torch.dtype) -> None:
    q, k, cos, sin = _rope_case(b, hq, hkv, t, d, dtype, seed=hq * 100 + t)
    got_q, got_k = apply_rope(q, k, cos, sin, use_triton=True)
    want_q, want_k = HF_ROPE(q, k, cos, sin)
    ref_q, ref_k = apply_rope_ref(q, k, cos, sin)
    assert torch.equal(want_q, ref_q) and torch.equal(want_k, ref_k)  # the reference is transformers' formula
    assert got_q.shape == q.shape and got_k.shape == k.shape
    for got, want in ((got_q, want_q), (got_k, want_k)):  # bf16 through the kernel, the rest the reference
        assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (1, 3, 4096), (5, 100)])
def test_rms_norm_kernel_equals_the_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEV, dtype)
    got = rms_norm(x, w, 1e-5, use_triton=True)
    want = rms_norm_ref(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == x.dtype
    err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)
    assert err.max() <= ULP[dtype] + 1e-6


def test_the_references_are_transformers_arithmetic() -> None:
    norm = modeling_llama.LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 48))
    x = torch.randn(3, 5, 48).to(torch.bfloat16)
    norm = norm.to(torch.bfloat16)
    assert torch.equal(modeling_llama.LlamaRMSNorm.forward(norm, x), rms_norm_ref(x, norm.weight, 1e-6))


def test_bad_calls_are_refused() -> None:
    q, k, cos, sin = _rope_case(1, 4, 2, 3, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(q, k[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)


def test_a_model_routed_through_the_fused_ops_gives_its_own_outputs(tiny_model_dir) -> None:  # noqa: ANN001
    """On this device the routed model's logits equal the unrouted one's (on the CPU both are transformers'
    arithmetic; on CUDA RoPE is bit-equal and RMSNorm within its tolerance, so greedy tokens agree)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    hf_rope = model_ops._HF_ROPE
    modeling_llama.apply_rotary_pos_emb = hf_rope  # an earlier default load in this process routed it
    plain = load_model(str(tiny_model_dir), device=device, dtype=dtype, progress=False, fused_ops=False)
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    fused = load_model(str(tiny_model_dir), device=device, dtype=dtype, progress=False)  # the default: fused on CUDA
    if device == "cpu":  # not routed by default there (the routers would only add a call); route it by hand
        assert modeling_llama.apply_rotary_pos_emb is hf_rope
        model_ops.use_fused_ops(fused.model)
    try:
        assert modeling_llama.apply_rotary_pos_emb is not hf_rope
        norms = [m for m in fused.model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm)]
        assert norms and all("forward" in vars(m) for m in norms)
        ids = torch.arange(5, 45, device=device)[None]
        with torch.no_grad():
            got = fused.model(input_ids=ids).logits.float()
            want = plain.model(input_ids=ids).logits.float()  # RoPE routed for it too: bit-equal
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max() <= 0.05 * want.abs().max()
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        model_ops.use_plain_ops(fused.model)  # and back: transformers' function and the class's forward again
        assert modeling_llama.apply_rotary_pos_emb is hf_rope
        assert not any("forward" in vars(m) for m in norms)
        with torch.no_grad():
            assert torch.equal(fused.model(input_ids=ids).logits.float(), want)
    finally:
        modeling_llama.apply_rotary_pos_emb = hf_rope


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels launch on CUDA only; elsewhere "
                    "transformers' ops run unchanged (the test above)")
def test_training_through_a_fused_model_still_has_gradients(tiny_model_dir) -> None:  # noqa: ANN001
    """With autograd recording the routed ops fall back to transformers' (the kernels have no backward)."""
    lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", progress=False)
    try:
        ids = torch.arange(5, 25, device="cuda")[None]
        lm.model(input_ids=ids, labels=ids).loss.backward()
        norm = next(m for m in lm.model.modules() if isinstance(m, modeling_llama.LlamaRMSNorm))
        assert norm.weight.grad is not None and torch.isfinite(norm.weight.grad).all()
    finally:
        model_ops.use_plain_ops(lm.model)
