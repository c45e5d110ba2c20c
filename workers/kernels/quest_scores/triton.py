"""Triton kernel of Quest's page upper-bound logits: ``scale * (q⁺ . kmax + q⁻ . kmin)`` in one launch.

Grid ``(Hkv, cdiv(U, BLOCK_U), cdiv(T * G, BLOCK_M))``: program ``(h, j, i)`` takes query rows
``r = t * G + g`` in ``[i * BLOCK_M, (i + 1) * BLOCK_M)`` of KV head ``h`` (every token's rows of a head
share its bounds, so the bounds are read once however many tokens there are) and pages
``[j * BLOCK_U, (j + 1) * BLOCK_U)``. It walks ``D`` in ``BLOCK_K`` chunks: a ``[BLOCK_M, BLOCK_K]`` chunk of
q (in the bounds' dtype: the launcher casts it) split into q⁺ and q⁻, and the matching
``[BLOCK_K, BLOCK_U]`` tiles of kmax and kmin, accumulated in float32 by two ``tl.dot``. Rows past ``T * G``,
channels past ``D`` and pages past ``U`` are masked (loads give 0), so any sizes work.

Why ``tl.dot`` with the G rows padded to ``BLOCK_M >= 16`` rather than a broadcast multiply + ``tl.sum``:
the op is bandwidth-bound (each bound is read once and used for ``T * G`` multiply-adds), so what matters
is keeping enough bytes in flight. Loads that feed ``tl.dot`` inside a loop are what Triton's software
pipeliner turns into multi-stage asynchronous copies into shared memory (``num_stages`` tiles in flight per
program, no registers held), the path its matmuls reach bandwidth with. The padding costs only tensor-core
time: 16 rows x 2 flops per bf16 element at ~3 TB/s is ~50 TFLOP/s, against ~800 on an H100. The
broadcast form loads into registers (a ``[G, BLOCK_K, BLOCK_U]`` product per chunk), converts every bf16
element to float32 and reduces over the channel axis across lanes and warps, all on the CUDA cores that
also issue the loads.
For float32 bounds the dot runs with ``input_precision="ieee"`` (float32 FMAs, no TF32), like cuBLAS's
default float32 matmul, so results match the torch path to float32 rounding; there the padded rows do
cost CUDA-core FMAs (~12 T/s of the H100's ~33 T/s at full bandwidth).

``MEMBERS`` (``quest_upper_bounds_members``): row ``t`` is one query token of its own member, each member with
its own bounds (same shape and strides) at ``koff[t]`` elements from ``kb``; program ``(h, j, i)`` takes member
``i // ROW_BLOCKS``'s rows ``g`` in block ``i % ROW_BLOCKS``, so a block never mixes two members' bounds. One
launch scores the members of a decode step together instead of one launch each (a captured step's node count,
not the bytes read, is what a batch of small members pays for).

``INTERPRET`` (the CPU interpreter): its ``tl.dot`` multiplies bf16 bit patterns as integers, so the
operands are upcast to float32 first (exact: a product of two bf16 values is exact in float32).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _quest_scores_kernel(q, kb, koff, out, M, U, G, H, ROW_BLOCKS, s_qt, s_qh, s_qg, s_qd, s_kh, s_kr, scale,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
                         MEMBERS: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (h, j, i): logits of query rows block i of KV head h over pages block j."""
    h = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    i = tl.program_id(2)
    if MEMBERS:  # rows of one member only: its own bounds
        member = i // ROW_BLOCKS
        g = (i % ROW_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = g < G
        t = tl.zeros([BLOCK_M], dtype=tl.int64) + member
        kb = kb + tl.load(koff + member)
    else:
        r = i * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < M
        t = (r // G).to(tl.int64)
        g = r % G
    q_rows = q + t * s_qt + h * s_qh + g * s_qg  # [BLOCK_M] row starts (q may be strided)
    u = j * BLOCK_U + tl.arange(0, BLOCK_U)
    u_ok = u < U
    k_hi = kb + h * s_kh  # kmax rows [0, D), kmin rows [D, 2D) of head h (rows s_kr apart: kb may be a page range)
    k_lo = k_hi + D * s_kr
    acc = tl.zeros([BLOCK_M, BLOCK_U], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        c_ok = c < D
        qc = tl.load(q_rows[:, None] + c[None, :] * s_qd, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        tile = c[:, None] * s_kr + u[None, :]
        tile_ok = c_ok[:, None] & u_ok[None, :]
        hi = tl.load(k_hi + tile, mask=tile_ok, other=0.0)
        lo = tl.load(k_lo + tile, mask=tile_ok, other=0.0)
        zero = tl.zeros_like(qc)  # tl.where keeps bf16 (tl.maximum would promote it to float32)
        qp = tl.where(qc > 0, qc, zero)
        qn = tl.where(qc < 0, qc, zero)
        if INTERPRET:  # the interpreter's dot multiplies bf16 bit patterns as integers: upcast (exact)
            qp, qn, hi, lo = qp.to(tl.float32), qn.to(tl.float32), hi.to(tl.float32), lo.to(tl.float32)
        acc = tl.dot(qp, hi, acc, input_precision="ieee")
        acc = tl.dot(qn, lo, acc, input_precision="ieee")
    dst = out + t[:, None] * (H * G * U) + h * (G * U) + g[:, None] * U + u[None, :]  # out [T, Hkv, G, U]
    tl.store(dst, acc * scale, mask=r_ok[:, None] & u_ok[None, :])
