"""Triton kernel of RoPE over a layer's queries and keys.

Grid ``(B * T, Hq + Hkv)``: program ``(r, h)`` rotates row ``h`` (a query head, then the key heads) of token
``r``. transformers computes ``q * cos + rotate_half(q) * sin`` as four elementwise kernels plus a
``torch.cat`` per tensor, each rounding to bf16; at decode that is ~10 launches per layer for a few KB.
Here each product and the sum are computed in float32 and rounded to bf16 in the same order (a product of two
bf16 values is exact in float32, and torch's elementwise ops compute in float32 and round once), so the
result is the same bits as transformers'. The intermediate roundings are done on the bits (``_round_bf16``):
a float32 -> bf16 -> float32 round trip through ``.to`` is not kept as written by the compiler (the H200
gave other bits, 1 ulp in a product, more after the sum cancels).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), as float32."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rope_kernel(q, k, cos, sin, qo, ko, T, HQ, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_cb, s_ct, s_sb, s_st,
                 s_ob, s_oh, s_ot, s_pb, s_ph, s_pt, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, h): head h (queries first, then keys) of token r = b * T + t."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = (r // T).to(tl.int64)
    t = (r % T).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < HALF
    c1 = tl.load(cos + b * s_cb + t * s_ct + d, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos + b * s_cb + t * s_ct + HALF + d, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin + b * s_sb + t * s_st + d, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin + b * s_sb + t * s_st + HALF + d, mask=m, other=0.0).to(tl.float32)
    if h < HQ:
        src = q + b * s_qb + h * s_qh + t * s_qt
        dst = qo + b * s_ob + h * s_oh + t * s_ot
    else:
        src = k + b * s_kb + (h - HQ) * s_kh + t * s_kt
        dst = ko + b * s_pb + (h - HQ) * s_ph + t * s_pt
    dt = qo.dtype.element_ty
    x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; each product rounded, then the sum rounded (transformers' order)
    o1 = _round_bf16(_round_bf16(x1 * c1) + _round_bf16(-x2 * s1)).to(dt)
    o2 = _round_bf16(_round_bf16(x2 * c2) + _round_bf16(x1 * s2)).to(dt)
    tl.store(dst + d, o1, mask=m)
    tl.store(dst + HALF + d, o2, mask=m)
