"""Triton kernel of the k-means assignment step: each point's nearest centroid, never the distance matrix.

Grid ``(H, cdiv(n, BLOCK_N))``: program ``(h, i)`` loads points ``[i * BLOCK_N, (i + 1) * BLOCK_N)`` of head
``h`` once (``[BLOCK_N, BLOCK_D]``, channels past ``D`` masked to 0) and walks the head's centroids in
``BLOCK_C`` blocks: one ``tl.dot`` gives the ``[BLOCK_N, BLOCK_C]`` products (float32 accumulation) and the
block's distances ``||c||^2 - 2 x . c`` (``||c||^2`` precomputed by the launcher, +inf past ``C``). A running
minimum and its index per (point, column slot) stay in registers, updated elementwise (no reduction across
lanes inside the loop); after the loop each point takes the minimum over its slots. Ties break to the lower
index, as the torch reference's ``argmin``: within a slot an equal distance in a later block does not
replace the earlier one (strict ``<``), and across slots the lowest index at the minimum is taken.

The distance rows are what the torch path wrote to memory (``[H, 8192, C]`` float32 per chunk, 4 GB at
``C = 16k``) and read back for ``argmin``; here they live one block at a time in registers, so the cost
is the products themselves, on tensor cores for bf16/fp16 operands and for float32 ones in
``input_precision="tf32"`` (``"ieee"``: float32 FMAs on the CUDA cores, like cuBLAS's default).

``INTERPRET`` (the CPU interpreter) works around two interpreter limits of triton 3.6: ``range`` cannot
take run-time bounds under numpy >= 2.4 (a ``while`` loop is used instead), and its ``tl.dot`` multiplies
bf16 bit patterns as integers (operands are upcast to float32 first, exact).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _centroid_block(xb, c_head, c2_head, c0, C, s_cc, s_cd, d, d_ok, best, arg,
                    BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """The running (minimum, index) per (point, column slot) updated with centroids ``[c0, c0 + BLOCK_C)``."""
    cols = c0 + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    cb = tl.load(c_head + cols.to(tl.int64)[None, :] * s_cc + d[:, None] * s_cd,
                 mask=d_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_C]: centroids transposed
    if INTERPRET:  # the interpreter's dot multiplies bf16 bit patterns as integers: upcast (exact)
        cb = cb.to(tl.float32)
    prod = tl.dot(xb, cb, input_precision=PRECISION)
    cn = tl.load(c2_head + cols, mask=c_ok, other=float("inf"))
    dist = cn[None, :] - 2.0 * prod
    better = dist < best  # strict: an equal distance in a later block keeps the slot's lower index
    return tl.where(better, dist, best), tl.where(better, cols[None, :], arg)


@triton.jit
def _kmeans_assign_kernel(x, c, c2, out, N, C, s_xh, s_xn, s_xd, s_ch, s_cc, s_cd,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                          PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (h, i): nearest centroid of head h's points block i."""
    h = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    rows = i * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    xb = tl.load(x + h * s_xh + rows.to(tl.int64)[:, None] * s_xn + d[None, :] * s_xd,
                 mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    c_head = c + h * s_ch
    c2_head = c2 + h * C
    best = tl.full([BLOCK_N, BLOCK_C], float("inf"), tl.float32)
    arg = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.int32)
    if INTERPRET:  # with numpy >= 2.4 the interpreter's range() cannot take run-time bounds: a while loop
        xb = xb.to(tl.float32)
        c0 = 0
        while c0 < C:
            best, arg = _centroid_block(xb, c_head, c2_head, c0, C, s_cc, s_cd, d, d_ok, best, arg,
                                        BLOCK_C, PRECISION, INTERPRET)
            c0 += BLOCK_C
    else:
        for c0 in range(0, C, BLOCK_C):
            best, arg = _centroid_block(xb, c_head, c2_head, c0, C, s_cc, s_cd, d, d_ok, best, arg,
                                        BLOCK_C, PRECISION, INTERPRET)
    # one reduction per point at the end: the minimum over slots, then the lowest index among the slots at it
    dmin = tl.min(best, axis=1)
    first = tl.min(tl.where(best == dmin[:, None], arg, C), axis=1)
    tl.store(out + h * N + rows, first.to(tl.int64), mask=r_ok)
