"""Public launcher for sparse decode attention, and the exact merge of partial results.

``sparse_decode_attention`` validates its arguments (raising ``ValueError`` that says
how to fix the call), picks the number of K splits and launches the Triton kernels in
``triton.py``. ``merge_attention_states`` (plain torch) merges ``(out, lse)`` pairs
computed over disjoint entry sets into the result over their union.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..launch import interpreting, next_pow2

__all__ = ["choose_num_splits", "merge_attention_states", "sparse_decode_attention"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INTS = (torch.int32, torch.int64)
_MAX_SPLITS = 64  # the reduce kernel holds all splits of a head in one block
_MAX_HEAD_DIM = 256
BLOCK_N = 128  # entries per inner-loop step (64 for D > 128, see _block_n); tuned on the H200
_empty = torch.empty  # every output/partial buffer is allocated here (tests poison it with NaN)


def _block_n(head_dim: int) -> int:
    """Entries per loop step: 128 (K+V tiles of 2 x 32 KiB in bf16 at D=128), 64 above D=128."""
    return BLOCK_N if head_dim <= 128 else BLOCK_N // 2


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # CPU interpreter: keep grids small so tests stay fast


def choose_num_splits(batch: int, kv_heads: int, n: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Splits of the N entries so that ``batch * kv_heads * splits`` covers ~2 waves of SMs.

    Each split gets at least one ``block_n`` block; at most ``_MAX_SPLITS`` splits.
    """
    if n <= block_n:
        return 1
    want = math.ceil(2 * _sm_count(device) / max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(n / block_n), _MAX_SPLITS))


def _fail(msg: str) -> None:
    raise ValueError(f"sparse_decode_attention: {msg}")


def _check(
    name: str, t: Any, shape: Sequence[int | None], dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    """Check a tensor argument's type, rank, sizes (None = any), dtype, device and last stride."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        _fail(f"{name} has shape {list(t.shape)}, expected {want} (see the docstring for each tensor's shape)")
    if t.dtype not in dtypes:
        _fail(f"{name} has dtype {t.dtype}; convert it with .to() to one of {[str(d) for d in dtypes]}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}; move all tensors to one device")
    if t.stride(-1) != 1 and t.shape[-1] > 1 and t.numel() > 0:
        _fail(f"{name} must be contiguous in its last dimension; pass {name}.contiguous()")


def _validate(q, k, v, scale, idx, n_valid, bias, pseudo_logits, pseudo_values) -> int:
    """Validate every argument; return N, the number of candidate entries per (b, kv head)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail("q must be a tensor of shape [B, Hq, D] (one decode token per sequence)")
    dev = q.device
    if dev.type != "cuda" and not interpreting():
        _fail(
            f"tensors are on {dev}; move them to a CUDA device (or set TRITON_INTERPRET=1 before "
            "importing triton to run the CPU interpreter)"
        )
    B, Hq, D = q.shape
    _check("q", q, [B, Hq, D], _FLOATS, dev)
    _check("k", k, [B, None, None, D], (q.dtype,), dev)
    Hkv, S = k.shape[1], k.shape[2]
    _check("v", v, [B, Hkv, S, D], (q.dtype,), dev)
    if not 1 <= D <= _MAX_HEAD_DIM:
        _fail(f"head dim D={D} must be in [1, {_MAX_HEAD_DIM}]")
    if Hkv == 0 or Hq % Hkv != 0:
        _fail(f"Hq={Hq} must be a positive multiple of Hkv={Hkv} (GQA: Hq = Hkv * G)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        _fail(f"scale must be a finite Python float (e.g. 1/sqrt(D)), got {scale!r}")
    if idx is not None:
        _check("idx", idx, [B, Hkv, None], _INTS, dev)
    N = idx.shape[2] if idx is not None else S
    if n_valid is not None:
        _check("n_valid", n_valid, [B, Hkv], _INTS, dev)
    if bias is not None:
        _check("bias", bias, [B, Hkv, N], (torch.float32,), dev)
    if (pseudo_logits is None) != (pseudo_values is None):
        _fail("pass pseudo_logits and pseudo_values together (or neither)")
    if pseudo_logits is not None:
        _check("pseudo_logits", pseudo_logits, [B, Hq, None], (torch.float32,), dev)
        _check("pseudo_values", pseudo_values, [B, Hq, pseudo_logits.shape[2], D], _FLOATS, dev)
    return N


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    idx: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    pseudo_logits: torch.Tensor | None = None,
    pseudo_values: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a gathered entry set plus pseudo-entries, under one softmax.

    Query head ``hq`` attends with KV head ``hq // G`` (``G = Hq // Hkv``). Entry ``j``
    of ``(b, h)`` is buffer row ``idx[b, h, j]`` with logit
    ``scale * q[b, hq] . k[b, h, idx[b, h, j]] + bias[b, h, j]``; pseudo-entry ``m`` of
    ``(b, hq)`` has logit ``pseudo_logits[b, hq, m]`` and value ``pseudo_values[b, hq, m]``.
    All are normalized together; logits of ``-inf`` contribute nothing.

    Parameters
    ----------
    q : [B, Hq, D] bfloat16, float16 or float32
        One decode token per sequence; ``Hq = Hkv * G``.
    k, v : [B, Hkv, S, D], same dtype as q
        KV buffer (a page cache, gathered entries, or the whole context).
    scale : float
        Logit scale, usually ``1 / sqrt(D)``.
    idx : [B, Hkv, N] int32 or int64, optional
        Rows of the buffer to attend, gathered inside the kernel; default ``0..S-1``
        (N = S). Must lie in ``[0, S)`` for the first ``n_valid`` entries (not checked:
        that would cost a device sync).
    n_valid : [B, Hkv] int32 or int64, optional
        Only the first ``n_valid[b, h]`` (clamped to ``[0, N]``) entries count; the
        rest are padding and are never read. Default N.
    bias : [B, Hkv, N] float32, optional
        Additive log-weight per entry (0 exact token, ``log s`` for a Double-P centroid
        stored in the buffer, ``-inf`` to drop).
    pseudo_logits : [B, Hq, M] float32, optional
        Precomputed logits (scale included), e.g. the phi completion ``log Z_R``.
    pseudo_values : [B, Hq, M, D] bfloat16, float16 or float32, optional
        Their values, e.g. ``N_R / Z_R``. Pass both pseudo tensors or neither.
    num_splits : int, optional
        Override the split-K heuristic (``choose_num_splits``); for tests and tuning.
    out : [B, Hq, D], dtype of q, optional
        Where to write the output (any strides, e.g. a column of a packed step's output: no copy after);
        returned as ``out``. Default: a new tensor.

    Returns
    -------
    out : [B, Hq, D], dtype of q
        Attention output; 0 where nothing is attended.
    lse : [B, Hq] float32
        Natural-log sum-exp of all logits (pseudo-entries included), ``-inf`` when
        nothing is attended; merge partial results with ``merge_attention_states``.
    """
    N = _validate(q, k, v, scale, idx, n_valid, bias, pseudo_logits, pseudo_values)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if out is None:
        out = _empty(B, Hq, D, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        _fail(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with contiguous channels, got {out.dtype} "
              f"{tuple(out.shape)} strides {out.stride()} on {out.device}")
    lse = _empty(B, Hq, device=q.device, dtype=torch.float32)
    if B == 0:
        return out, lse
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, N, q.device, _block_n(D))
    if not isinstance(num_splits, int) or not 1 <= num_splits <= _MAX_SPLITS:
        _fail(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
    has_pseudo = pseudo_logits is not None and pseudo_logits.shape[2] > 0
    _launch(
        q,
        k,
        v,
        scale,
        idx,
        n_valid,
        bias,
        pseudo_logits if has_pseudo else None,
        pseudo_values if has_pseudo else None,
        out,
        lse,
        N,
        num_splits,
    )
    return out, lse


def _launch(
    q,
    k,
    v,
    scale,
    idx,
    n_valid,
    bias,
    pl,
    pv,
    out,
    lse,
    N,
    num_splits,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Size the grid and launch the split kernel, then the reduce kernel if needed."""
    from .triton import LOG2E, _sparse_decode_reduce_kernel, _sparse_decode_split_kernel

    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    block_n = block_n or _block_n(D)
    chunk = block_n * max(1, math.ceil(math.ceil(N / num_splits) / block_n))
    num_splits = max(1, math.ceil(N / chunk))
    direct = num_splits == 1 and pl is None
    block_d = max(16, next_pow2(D))
    if direct:
        o_part = lse_part = lse
    else:
        o_part = _empty(B, Hq, num_splits, D, device=q.device, dtype=torch.float32)
        lse_part = _empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)
    dummy = lse
    ib, ih = (idx.stride(0), idx.stride(1)) if idx is not None else (0, 0)
    nb, nh = (n_valid.stride(0), n_valid.stride(1)) if n_valid is not None else (0, 0)
    bb, bh = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    _sparse_decode_split_kernel[(B * Hkv, num_splits)](
        q,
        k,
        v,
        idx if idx is not None else dummy,
        n_valid if n_valid is not None else dummy,
        bias if bias is not None else dummy,
        o_part,
        lse_part,
        out,
        lse,
        float(scale) * LOG2E,
        N,
        Hkv,
        chunk,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        ib,
        ih,
        nb,
        nh,
        bb,
        bh,
        out.stride(0),
        out.stride(1),
        G=G,
        D=D,
        NUM_SPLITS=num_splits,
        HAS_IDX=idx is not None,
        HAS_NVALID=n_valid is not None,
        HAS_BIAS=bias is not None,
        DIRECT=direct,
        IEEE=q.dtype == torch.float32,
        INTERPRET=interpreting(),
        BLOCK_G=max(16, next_pow2(G)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if direct:
        return
    M = pl.shape[2] if pl is not None else 0
    plb, plh = (pl.stride(0), pl.stride(1)) if pl is not None else (0, 0)
    pvb, pvh, pvm = (pv.stride(0), pv.stride(1), pv.stride(2)) if pv is not None else (0, 0, 0)
    _sparse_decode_reduce_kernel[(B * Hq,)](
        o_part,
        lse_part,
        pl if pl is not None else dummy,
        pv if pv is not None else dummy,
        out,
        lse,
        M,
        plb,
        plh,
        pvb,
        pvh,
        pvm,
        out.stride(0),
        out.stride(1),
        Hq,
        D=D,
        NUM_SPLITS=num_splits,
        HAS_PSEUDO=pl is not None,
        BLOCK_S=next_pow2(num_splits),
        BLOCK_M=16,
        BLOCK_D=block_d,
        num_warps=4,
    )


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over P disjoint entry sets into the result over their union.

    Parameters
    ----------
    outs : [P, B, Hq, D] float tensor
        Normalized partial outputs (0 where a part is empty).
    lses : [P, B, Hq] float tensor
        Their natural-log sum-exps (``-inf`` for an empty part).

    Returns
    -------
    out : [B, Hq, D], dtype of outs
        ``sum_p exp(lse_p - lse) * out_p``; 0 where every part is empty.
    lse : [B, Hq] float32 (float64 if lses is float64)
        ``logsumexp_p lse_p``; ``-inf`` where every part is empty.
    """
    if outs.dim() != 4 or lses.shape != outs.shape[:3]:
        raise ValueError(
            f"merge_attention_states: outs must be [P, B, Hq, D] and lses [P, B, Hq]; got "
            f"{list(outs.shape)} and {list(lses.shape)}"
        )
    if outs.shape[0] == 0:
        raise ValueError("merge_attention_states: need at least one part (P >= 1)")
    work = torch.float64 if lses.dtype == torch.float64 else torch.float32
    lses_w = lses.to(work)
    m = lses_w.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lses_w - m_safe)  # [P, B, Hq]; 0 for empty parts
    z = w.sum(dim=0)
    wd = w.unsqueeze(-1)
    num = torch.where(wd > 0, wd * outs.to(work), 0.0).sum(dim=0)  # an empty part's out is ignored
    out = torch.where(z.unsqueeze(-1) > 0, num / torch.where(z > 0, z, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(z > 0, m_safe + torch.log(torch.where(z > 0, z, 1.0)), float("-inf"))
    return out.to(outs.dtype), lse
