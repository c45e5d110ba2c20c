"""Triton kernels of the unit top-k: one program per row, a radix select of the k-th largest score.

Scores are mapped to order-preserving int32 keys (a float's bits, sign-folded), written to a scratch
row, and the k-th largest key is found one 8-bit digit at a time from the top (4 histogram passes
over the row, which stays in L1/L2). The ids above it, then the lowest-id ties equal to it, are
written in ascending id order with a running prefix sum. No sort and no host sync: shapes depend on
``k`` only, so a step that selects this way can be captured in a CUDA graph. ``_group_mass_pass`` first turns ``[G, U]``
logits into the group-mean softmax mass (two passes: per-head log-sum-exp, then the mean).
Loops are ``while`` loops: the CPU interpreter (numpy >= 2.4) cannot take run-time ``range`` bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keys(x):
    """Float32 -> int32 keys in the same order (negatives' magnitude bits flipped; -0.0 taken as +0.0)."""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unsigned(k32, ok):
    """Int32 keys -> int64 in ``[0, 2**32)`` (their unsigned order); lanes not ``ok`` give 0."""
    return tl.where(ok, k32.to(tl.int64) + 2147483648, 0)


@triton.jit
def _load_keys(row, u0, u, U):
    """A chunk of a row's int32 keys, unsigned (``_unsigned``; lanes past ``U`` 0)."""
    um = (u0 + u) < U
    return _unsigned(tl.load(row + u0 + u, mask=um, other=0), um)


@triton.jit
def _lse(ref, s):
    """Log-sum-exp from a reference max ``ref`` (0 for an all -inf head) and ``s = sum exp(x - ref)``; +inf when
    ``s`` is 0, so an all -inf head gives mass 0 everywhere."""
    return tl.where(s > 0, ref + tl.log(tl.where(s > 0, s, 1.0)), float("inf"))


@triton.jit
def _digit_hist(kk, ok, prefix, p):
    """Histogram of digit ``p`` (8 bits, most significant first) of the keys that agree with ``prefix`` on the
    digits before it (all keys for ``p = 0``)."""
    shift = 24 - 8 * p
    active = ok & ((kk >> (shift + 8)) == (prefix >> (shift + 8)))
    return tl.histogram(((kk >> shift) & 255).to(tl.int32), 256, mask=active)


@triton.jit
def _choose_digit(hist, prefix, need, p):
    """The ``need``-th largest active key's digit ``p`` from its histogram: (the prefix with it, how many keys
    equal to the new prefix are still to take)."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # active keys whose digit is >= each bin
    d = tl.max(tl.where(at_least >= need, bins, -1), 0)
    need -= tl.sum(tl.where(bins == d, at_least - hist, 0), 0)  # keys above it are all taken
    return prefix | (d.to(tl.int64) << (24 - 8 * p)), need


@triton.jit
def _emit(out_row, ids, ok, kk, prefix, need, taken, ties, K):
    """Write the ids of a chunk's taken keys (greater than ``prefix``, then ties while fewer than ``need`` were
    met before) after ``taken`` earlier ids; returns (ids written, ties met) in the chunk."""
    eq = (ok & (kk == prefix)).to(tl.int32)
    eq_rank = ties + tl.cumsum(eq, 0) - eq
    sel = ((ok & (kk > prefix)) | ((eq == 1) & (eq_rank < need))).to(tl.int32)
    pos = taken + tl.cumsum(sel, 0) - sel
    tl.store(out_row + pos, ids.to(tl.int64), mask=(sel == 1) & (pos < K))  # never past the row
    return tl.sum(sel, 0), tl.sum(eq, 0)


@triton.jit
def _group_mass_pass(logits, keys, r, U, G, stride_r, stride_g, BLOCK_G: tl.constexpr, BLOCK_U: tl.constexpr):
    """Row ``r``: the group-mean softmax mass of ``logits[r] [G, U]`` -> int32 keys in ``keys[r]``."""
    g = tl.arange(0, BLOCK_G)
    u = tl.arange(0, BLOCK_U)
    gm = g < G
    base = logits + r * stride_r + g[:, None] * stride_g
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    u0 = 0
    while u0 < U:
        ok = gm[:, None] & ((u0 + u) < U)[None, :]
        x = tl.load(base + u0 + u[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 1))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf row so far: no NaN from -inf - -inf
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref[:, None]), 1)
        m = m_new
        u0 += BLOCK_U
    lse = _lse(tl.where(m == float("-inf"), 0.0, m), s)
    u0 = 0
    while u0 < U:
        um = (u0 + u) < U
        ok = gm[:, None] & um[None, :]
        x = tl.load(base + u0 + u[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        mass = tl.sum(tl.exp(x - lse[:, None]), 0) / G
        tl.store(keys + r * U + u0 + u, _keys(mass), mask=um)
        u0 += BLOCK_U


@triton.jit
def _select_pass(keys, out, r, U, K, BLOCK_U: tl.constexpr):
    """Row ``r``: the ids of the ``K`` largest keys of ``keys[r]`` (ties to the lower id) -> ``out[r]``, ascending."""
    u = tl.arange(0, BLOCK_U)
    row = keys + r * U
    prefix = tl.zeros([], tl.int64)
    need = K
    for p in tl.static_range(4):  # one 8-bit digit per pass, most significant first
        hist = tl.zeros([256], tl.int32)
        u0 = 0
        while u0 < U:
            hist += _digit_hist(_load_keys(row, u0, u, U), (u0 + u) < U, prefix, p)
            u0 += BLOCK_U
        prefix, need = _choose_digit(hist, prefix, need, p)
    # prefix is now the K-th largest key: every greater key is taken, then the first ``need`` ties.
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    u0 = 0
    while u0 < U:
        n_sel, n_eq = _emit(out + r * K, u0 + u, (u0 + u) < U, _load_keys(row, u0, u, U), prefix, need, taken,
                            ties, K)
        taken += n_sel
        ties += n_eq
        u0 += BLOCK_U


@triton.jit
def _group_top_kernel(logits, keys, out, U, K, G, stride_r, stride_g, BLOCK_G: tl.constexpr,
                      BLOCK_U: tl.constexpr):
    """Program ``r``: the ``K`` units of row ``r`` with the most group-mean softmax mass."""
    r = tl.program_id(0).to(tl.int64)
    _group_mass_pass(logits, keys, r, U, G, stride_r, stride_g, BLOCK_G, BLOCK_U)
    tl.debug_barrier()  # the row's keys are written before any thread counts them
    _select_pass(keys, out, r, U, K, BLOCK_U)


@triton.jit
def _top_kernel(scores, keys, out, U, K, stride_r, BLOCK_U: tl.constexpr):
    """Program ``r``: the ``K`` units of row ``r`` with the highest score."""
    r = tl.program_id(0).to(tl.int64)
    u = tl.arange(0, BLOCK_U)
    u0 = 0
    while u0 < U:
        um = (u0 + u) < U
        x = tl.load(scores + r * stride_r + u0 + u, mask=um, other=0.0).to(tl.float32)
        tl.store(keys + r * U + u0 + u, _keys(x), mask=um)
        u0 += BLOCK_U
    tl.debug_barrier()
    _select_pass(keys, out, r, U, K, BLOCK_U)
