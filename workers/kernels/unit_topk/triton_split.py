"""Triton kernels of the unit top-k with each row split over ``C`` programs of ``CHUNK`` units.

The one-program-per-row kernels (``triton.py``) walk a row serially, so at thousands of units a row
costs tens of microseconds whatever the number of rows. Here every pass runs one program per (row,
chunk), and a row's programs meet in small global tables: the per-chunk ``(max, sum exp)`` of each
head (``parts``), one 256-bin histogram per radix digit (``hist``, atomically added) and the per-chunk
counts of taken keys (``counts``). Each program re-derives the digits chosen so far from ``hist`` (a
few 256-wide vector ops) instead of waiting for another program. Passes: head log-sum-exp parts; mass,
keys and the first digit's histogram; three more digit histograms; counts; ids. The result is the
one-program kernels' exactly (same keys, same tie rule, ascending ids).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton import _choose_digit, _digit_hist, _emit, _keys, _lse, _unsigned


@triton.jit
def _chunk_keys(keys, r, c, U, CHUNK: tl.constexpr):
    """Chunk ``c`` of row ``r``: unit ids, whether each is in the row, and its key, unsigned."""
    u = c * CHUNK + tl.arange(0, CHUNK)
    ok = u < U
    return u, ok, _unsigned(tl.load(keys + r * U + u, mask=ok, other=0), ok)


@triton.jit
def _add_hist(hist, r, p, kk, ok, prefix):
    """Add the chunk's histogram of digit ``p`` to the row's (``_digit_hist``)."""
    h = _digit_hist(kk, ok, prefix, p)
    tl.atomic_add(hist + (r * 4 + p) * 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _prefix(hist, r, K, PASSES: tl.constexpr):
    """The digits of the ``K``-th largest key chosen by the row's first ``PASSES`` histograms, and how many keys
    equal to that prefix are still to take."""
    prefix = tl.zeros([], tl.int64)
    need = K
    for p in tl.static_range(PASSES):
        prefix, need = _choose_digit(tl.load(hist + (r * 4 + p) * 256 + tl.arange(0, 256)), prefix, need, p)
    return prefix, need


@triton.jit
def _lse_parts_kernel(logits, parts, U, G, C, stride_r, stride_g, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``(r, c)``: each head's max and sum of exp over chunk ``c`` -> ``parts[r, c, g]``."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    u = c * CHUNK + tl.arange(0, CHUNK)
    ok = (g < G)[:, None] & (u < U)[None, :]
    x = tl.load(logits + r * stride_r + g[:, None] * stride_g + u[None, :], mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 1)
    ref = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: sum 0, no NaN
    s = tl.sum(tl.exp(x - ref[:, None]), 1)
    at = parts + ((r * C + c) * BLOCK_G + g) * 2
    tl.store(at, m)
    tl.store(at + 1, s)


@triton.jit
def _mass_keys_kernel(logits, parts, keys, hist, U, G, C, stride_r, stride_g, BLOCK_G: tl.constexpr,
                      BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``(r, c)``: the row's head log-sum-exps from ``parts``, the chunk's group-mean mass as keys,
    and the first digit's histogram."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    cc = tl.arange(0, BLOCK_C)
    at = parts + ((r * C + cc[:, None]) * BLOCK_G + g[None, :]) * 2
    m = tl.load(at, mask=(cc < C)[:, None], other=float("-inf"))
    s = tl.load(at + 1, mask=(cc < C)[:, None], other=0.0)
    mx = tl.max(m, 0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    lse = _lse(ref, tl.sum(s * tl.exp(m - ref[None, :]), 0))
    u = c * CHUNK + tl.arange(0, CHUNK)
    um = u < U
    ok = (g < G)[:, None] & um[None, :]
    x = tl.load(logits + r * stride_r + g[:, None] * stride_g + u[None, :], mask=ok, other=float("-inf"))
    mass = tl.sum(tl.exp(x.to(tl.float32) - lse[:, None]), 0) / G
    kk32 = _keys(mass)
    tl.store(keys + r * U + u, kk32, mask=um)
    _add_hist(hist, r, 0, _unsigned(kk32, um), um, tl.zeros([], tl.int64))


@triton.jit
def _score_keys_kernel(scores, keys, hist, U, stride_r, CHUNK: tl.constexpr):
    """Program ``(r, c)``: the chunk's scores as keys, and the first digit's histogram."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    u = c * CHUNK + tl.arange(0, CHUNK)
    um = u < U
    kk32 = _keys(tl.load(scores + r * stride_r + u, mask=um, other=0.0).to(tl.float32))
    tl.store(keys + r * U + u, kk32, mask=um)
    _add_hist(hist, r, 0, _unsigned(kk32, um), um, tl.zeros([], tl.int64))


@triton.jit
def _digit_kernel(keys, hist, U, K, PASS: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``(r, c)``: the chunk's histogram of digit ``PASS`` over keys matching the digits chosen so far."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    prefix, _ = _prefix(hist, r, K, PASS)
    _, ok, kk = _chunk_keys(keys, r, c, U, CHUNK)
    _add_hist(hist, r, PASS, kk, ok, prefix)


@triton.jit
def _count_kernel(keys, hist, counts, U, K, C, CHUNK: tl.constexpr):
    """Program ``(r, c)``: how many of the chunk's keys are above the ``K``-th largest, and equal to it."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    prefix, _ = _prefix(hist, r, K, 4)
    _, ok, kk = _chunk_keys(keys, r, c, U, CHUNK)
    tl.store(counts + (r * C + c) * 2, tl.sum((ok & (kk > prefix)).to(tl.int32), 0))
    tl.store(counts + (r * C + c) * 2 + 1, tl.sum((ok & (kk == prefix)).to(tl.int32), 0))


@triton.jit
def _emit_kernel(keys, hist, counts, out, U, K, C, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``(r, c)``: the chunk's taken ids, at their place in the row's ascending output."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    prefix, need = _prefix(hist, r, K, 4)
    cc = tl.arange(0, BLOCK_C)
    gt_c = tl.load(counts + (r * C + cc) * 2, mask=cc < C, other=0)
    eq_c = tl.load(counts + (r * C + cc) * 2 + 1, mask=cc < C, other=0)
    ties_before = tl.cumsum(eq_c, 0) - eq_c
    took_eq = tl.minimum(tl.maximum(need - ties_before, 0), eq_c)  # ties go to the lowest ids
    earlier = cc < c
    taken = tl.sum(tl.where(earlier, gt_c + took_eq, 0), 0)
    ties = tl.sum(tl.where(earlier, eq_c, 0), 0)
    u, ok, kk = _chunk_keys(keys, r, c, U, CHUNK)
    _emit(out + r * K, u, ok, kk, prefix, need, taken, ties, K)
