"""Triton kernel of the own-row write.

Grid ``(M, Hkv)``: program ``(m, h)`` copies member ``m``'s new K and V row of KV head ``h`` (``D`` channels)
to row ``at[m]`` of that member's own buffers. Members' buffers are separate allocations of different sizes:
``table[m]`` holds, in elements from ``base`` (member 0's K buffer), where member ``m``'s K and V buffers start,
and their head and token strides. A step of ``M`` members then writes its own K/V in one launch, not ``2 M``
``index_copy_`` launches (in a captured step each launch is a graph node, and the nodes, not the bytes, are
what a batch of small members pays for).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _own_rows_kernel(k, v, at, table, base, s_km, s_kh, s_vm, s_vh, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (m, h): member m's K and V row of head h to its own buffers at row at[m]."""
    m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    row = table + m * 4
    k_off, v_off = tl.load(row), tl.load(row + 1)
    s_h, s_t = tl.load(row + 2), tl.load(row + 3)
    pos = tl.load(at + m).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    kx = tl.load(k + m * s_km + h * s_kh + d, mask=ok)
    vx = tl.load(v + m * s_vm + h * s_vh + d, mask=ok)
    dst = h * s_h + pos * s_t + d
    tl.store(base + k_off + dst, kx.to(base.dtype.element_ty), mask=ok)
    tl.store(base + v_off + dst, vx.to(base.dtype.element_ty), mask=ok)
