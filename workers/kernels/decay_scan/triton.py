"""Triton kernels of the decay scan: one program per (segment, head, block of channels).

A program walks its segment in chunks of ``BLOCK_T`` tokens. Within a chunk the linear recurrence
``h_t = a_t h_{t-1} + b_t`` is one ``tl.associative_scan`` over ``(a, b)`` pairs (the combine of two
steps is again such a step), so the sequential part is the loop over chunks, carrying one state
vector. Padding rows take ``(a, b) = (1, 0)``, which leaves the state unchanged, so the chunk's last
row always holds the state to carry. The backward pass runs the adjoint recurrence
``δ_t = dy_t + g_{t+1} δ_{t+1}`` the same way over the segment reversed (chunks loaded back to front).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _combine(a1, b1, a2, b2):
    """Step ``(a1, b1)`` then ``(a2, b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _fwd_kernel(x, g, h0, y, cu, sxn, sxh, sgn, sgh, syn, syh, shs, shh, D,
                HAS_H0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[n] = g[n] y[n-1] + (1 - g[n]) x[n] over segment ``program_id(0)``, head ``program_id(1)``."""
    s = tl.program_id(0)
    hd = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    start = tl.load(cu + s).to(tl.int64)
    end = tl.load(cu + s + 1).to(tl.int64)
    if HAS_H0:
        h = tl.load(h0 + s.to(tl.int64) * shs + hd * shh + d, mask=dm, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_D], dtype=tl.float32)
    r = tl.arange(0, BLOCK_T)
    last = (r == BLOCK_T - 1)[:, None]
    c = start
    while c < end:  # a while loop: a ``range`` over loaded bounds fails under the interpreter
        rows = c + r
        m = (rows < end)[:, None] & dm[None, :]
        xv = tl.load(x + rows[:, None] * sxn + hd * sxh + d[None, :], mask=m, other=0.0).to(tl.float32)
        gv = tl.load(g + rows[:, None] * sgn + hd * sgh + d[None, :], mask=m, other=1.0).to(tl.float32)
        a, b = tl.associative_scan((gv, (1.0 - gv) * xv), 0, _combine)
        yv = b + a * h[None, :]
        tl.store(y + rows[:, None] * syn + hd * syh + d[None, :], yv.to(y.dtype.element_ty), mask=m)
        h = tl.sum(tl.where(last, yv, 0.0), axis=0)
        c += BLOCK_T


@triton.jit
def _bwd_kernel(dy, x, g, y, h0, cu, dx, dg, dh0, sxn, sxh, sgn, sgh, syn, syh, shs, shh, D,
                HAS_H0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx, dg (and dh0) of one (segment, head, channel block); dy, dx, dg share x's strides; y is the forward
    output (the state before each token, one row back)."""
    s = tl.program_id(0)
    hd = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    start = tl.load(cu + s).to(tl.int64)
    end = tl.load(cu + s + 1).to(tl.int64)
    if HAS_H0:
        hinit = tl.load(h0 + s.to(tl.int64) * shs + hd * shh + d, mask=dm, other=0.0).to(tl.float32)
    else:
        hinit = tl.zeros([BLOCK_D], dtype=tl.float32)
    r = tl.arange(0, BLOCK_T)
    last = (r == BLOCK_T - 1)[:, None]
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    hi = end
    while hi > start:
        rows = hi - 1 - r  # descending: row 0 of the tile is the chunk's latest token
        valid = rows >= start
        m = valid[:, None] & dm[None, :]
        xo = rows[:, None] * sxn + hd * sxh + d[None, :]
        go = rows[:, None] * sgn + hd * sgh + d[None, :]
        dyv = tl.load(dy + xo, mask=m, other=0.0).to(tl.float32)
        nxt = m & (rows + 1 < end)[:, None]
        a = tl.load(g + go + sgn, mask=nxt, other=0.0).to(tl.float32)  # g_{t+1}; 0 after the segment's end
        a = tl.where(m, a, 1.0)
        aa, bb = tl.associative_scan((a, dyv), 0, _combine)
        delta = bb + aa * carry[None, :]
        gv = tl.load(g + go, mask=m, other=0.0).to(tl.float32)
        xv = tl.load(x + xo, mask=m, other=0.0).to(tl.float32)
        before = m & (rows > start)[:, None]
        hp = tl.load(y + rows[:, None] * syn - syn + hd * syh + d[None, :], mask=before, other=0.0).to(tl.float32)
        hp = tl.where((rows == start)[:, None], hinit[None, :], hp)
        tl.store(dx + xo, ((1.0 - gv) * delta).to(dx.dtype.element_ty), mask=m)
        tl.store(dg + go, (delta * (hp - xv)).to(dg.dtype.element_ty), mask=m)
        carry = tl.sum(tl.where(last, delta, 0.0), axis=0)
        hi -= BLOCK_T
    if HAS_H0:
        g0 = tl.load(g + start * sgn + hd * sgh + d, mask=dm & (end > start), other=0.0).to(tl.float32)
        tl.store(dh0 + s.to(tl.int64) * shs + hd * shh + d, (g0 * carry).to(dh0.dtype.element_ty), mask=dm)
