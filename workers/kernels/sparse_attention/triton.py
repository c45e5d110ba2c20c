"""Triton kernels for split-K sparse decode attention ("flash-decoding").

Two kernels:

``_sparse_decode_split_kernel``
    grid ``(B * Hkv, num_splits)``. A program owns one KV head of one sequence and
    one contiguous chunk of the N gathered entries, and serves all ``G`` query heads
    of that KV head at once (the ``G`` rows of ``q`` are padded to ``BLOCK_G >= 16``
    so that ``q @ k^T`` is a tensor-core ``tl.dot``), so every K/V row is read once
    per group. It loops over its chunk in blocks of ``BLOCK_N`` entries: gathers the
    rows through ``idx`` (masked loads: padding past ``n_valid`` is never read),
    adds the per-entry log-weight ``bias``, and runs an online softmax in base 2 with
    fp32 accumulators. It writes either the final ``out``/``lse`` (``DIRECT``: one
    split and no pseudo-entries) or a partial ``(out_s, lse_s)`` per split.

``_sparse_decode_reduce_kernel``
    grid ``(B * Hq,)``. Merges the splits' partial results and the per-query-head
    pseudo-entries (``pseudo_logits``, ``pseudo_values``) under one normalization
    and writes ``out`` (dtype of q) and the natural-log ``lse``.

``INTERPRET`` (the CPU interpreter) works around two interpreter limits of triton
3.6: ``range`` cannot take run-time bounds under numpy >= 2.4 (a ``while`` loop is
used instead), and its ``tl.dot`` multiplies bf16 bit patterns as integers (operands
are upcast to fp32 after the same rounding the GPU path does).

Empty sets give ``lse = -inf`` and ``out = 0``: every max is made "safe" (``-inf``
becomes 0 before it is subtracted) so no ``inf - inf`` NaN can arise. Offsets into
the KV buffer are computed in int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the launcher folds it into qk_scale


@triton.jit
def _attend_block(
    q,
    k_base,
    v_base,
    i_base,
    bias_base,
    n0,
    stop,
    qk_scale,
    stride_ks,
    stride_vs,
    m_i,
    l_i,
    acc,
    offs_d,
    mask_d,
    HAS_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step (base 2) over entries ``n0 .. n0 + BLOCK_N`` (masked at ``stop``)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < stop
    if HAS_IDX:
        rows = tl.load(i_base + offs_n, mask=mask_n, other=0).to(tl.int64)
    else:
        rows = offs_n.to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_base + rows[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    if INTERPRET:  # the interpreter's dot multiplies bf16 bit patterns as integers: upcast
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if HAS_BIAS:
        bias = tl.load(bias_base + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        s = s + bias[None, :] * 1.4426950408889634
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + rows[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    p_v = p.to(v.dtype)  # P is rounded to the value dtype for the tensor-core dot
    if INTERPRET:
        v = v.to(tl.float32)
        p_v = p_v.to(tl.float32)
    if IEEE:
        pv = tl.dot(p_v, v, input_precision="ieee")
    else:
        pv = tl.dot(p_v, v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _sparse_decode_split_kernel(
    Q,
    K,
    V,
    IDX,
    NVALID,
    BIAS,  # inputs
    O_PART,
    LSE_PART,
    O,
    LSE,  # outputs (partials or final)
    qk_scale,  # scale * log2(e)
    N,
    Hkv,
    chunk,  # entries per (b, h); KV heads; entries per split (multiple of BLOCK_N)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ib,
    stride_ih,
    stride_nb,
    stride_nh,
    stride_bb,
    stride_bh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_IDX: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hkv
    h = pid_bh % Hkv

    n_end = N
    if HAS_NVALID:
        nv = tl.load(NVALID + b * stride_nb + h * stride_nh).to(tl.int64)
        n_end = tl.minimum(tl.maximum(nv, 0), N)
    start = split * chunk
    stop = tl.minimum(start + chunk, n_end)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    hq = h * G + offs_g  # query heads of this KV head
    q = tl.load(
        Q + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    i_base = IDX + b * stride_ib + h * stride_ih
    bias_base = BIAS + b * stride_bb + h * stride_bh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if INTERPRET:  # CPU interpreter: with numpy >= 2.4 its range() cannot take run-time bounds
        q = q.to(tl.float32)
        n0 = start
        while n0 < stop:
            m_i, l_i, acc = _attend_block(
                q,
                k_base,
                v_base,
                i_base,
                bias_base,
                n0,
                stop,
                qk_scale,
                stride_ks,
                stride_vs,
                m_i,
                l_i,
                acc,
                offs_d,
                mask_d,
                HAS_IDX,
                HAS_BIAS,
                IEEE,
                INTERPRET,
                BLOCK_N,
            )
            n0 += BLOCK_N
    else:
        for n0 in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q,
                k_base,
                v_base,
                i_base,
                bias_base,
                n0,
                stop,
                qk_scale,
                stride_ks,
                stride_vs,
                m_i,
                l_i,
                acc,
                offs_d,
                mask_d,
                HAS_IDX,
                HAS_BIAS,
                IEEE,
                INTERPRET,
                BLOCK_N,
            )

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out_mask = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(
            O + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty), mask=out_mask
        )
        tl.store(LSE + b * (Hkv * G) + hq, lse, mask=mask_g)
    else:
        row = (b * (Hkv * G) + hq) * NUM_SPLITS + split  # O_PART is [B, Hq, NUM_SPLITS, D] contiguous
        tl.store(O_PART + row[:, None] * D + offs_d[None, :], out, mask=out_mask)
        tl.store(LSE_PART + row, lse, mask=mask_g)


@triton.jit
def _sparse_decode_reduce_kernel(
    O_PART,
    LSE_PART,
    PL,
    PV,
    O,
    LSE,
    M,  # pseudo-entries per query head
    stride_plb,
    stride_plh,
    stride_pvb,
    stride_pvh,
    stride_pvm,
    stride_ob,
    stride_oh,
    Hq,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_PSEUDO: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * Hq + hq
    b = pid // Hq
    hq = pid % Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < D

    lse_s = tl.load(LSE_PART + pid * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    o_s = tl.load(
        O_PART + (pid * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.max(lse_s, axis=0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.exp(lse_s - m_safe)
    l_i = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * o_s, axis=0)
    if HAS_PSEUDO:
        pl_base = PL + b * stride_plb + hq * stride_plh
        pv_base = PV + b * stride_pvb + hq * stride_pvh
        m0 = 0
        while m0 < M:  # few pseudo-entries; a while loop also runs in the CPU interpreter
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            pl = tl.load(pl_base + offs_m, mask=mask_m, other=float("-inf")).to(tl.float32)
            pv = tl.load(
                pv_base + offs_m.to(tl.int64)[:, None] * stride_pvm + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(pl, axis=0))
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_new_safe)
            p = tl.exp(pl - m_new_safe)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * pv, axis=0)
            m_i = m_new
            m_safe = m_new_safe
            m0 += BLOCK_M
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(O + b * stride_ob + hq * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)
    tl.store(LSE + pid, lse)
