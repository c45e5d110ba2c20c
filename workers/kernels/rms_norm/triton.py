"""Triton kernel of RMSNorm.

Grid ``(rows,)``: program ``r`` normalizes row ``r`` (``N`` channels, held at once). transformers' module runs
about seven kernels per call (cast, square, mean, add, rsqrt, multiply, cast, weight multiply), three calls
per layer at decode, each a launch for a few KB. The arithmetic is the module's: float32 sum of squares
divided by ``N``, reciprocal square root, the normalized row rounded to the input dtype, then the weight's
product rounded again (bf16 rows only: the cast is rounded on the bits, as in the RoPE kernel). The sum's
order differs from torch's reduction, so results may differ from the
module's in the last bit of the float32 mean.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..rope.triton import _round_bf16


@triton.jit
def _rms_norm_kernel(x, w, out, N, s_x, s_o, eps, BLOCK: tl.constexpr):
    """Program r: row r of x [rows, N] -> out."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < N
    h = tl.load(x + r * s_x + c, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    y = _round_bf16(h * (1.0 / tl.sqrt(var + eps)))  # the normalized row in bf16, as the module casts it
    wt = tl.load(w + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out + r * s_o + c, (wt * y).to(out.dtype.element_ty), mask=m)
