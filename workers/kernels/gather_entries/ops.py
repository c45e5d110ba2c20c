"""Launcher of the CPU gather-entries kernel (``kernel.cpp``): a decode row's attended K/V entries from a pool.

``gather_entries`` gives what the sparse path's torch form builds before its attention for one query row
(``sparse._append`` of the exact and extra rows, then ``sparse_decode_attention_torch``'s gather and masks): the
entries' keys and values, valid ones first, and a bias row (0 for exact rows, the extra rows' bias, ``-inf`` for
padding), bit for bit (``gather_entries_ref``). ``attend_entries`` is that torch form's attention over them (the
same float ops in the same order, so the same bits).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from native.build import CpuKernelBuild, load_library

__all__ = ["attend_entries", "cpu_kernel_available", "gather_entries", "gather_entries_usable"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> Any | None:
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="gather_entries",
                       fallback="sparse decode rows gather with torch")
    if lib is None:
        return None
    fn = lib.kvstash_gather_entries
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr] + [i64] * 4 + [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def gather_entries_usable(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``gather_entries`` takes these float32 CPU pools ``[Hkv, S, D]`` (rows contiguous, K and V laid out
    alike), and the kernel is built."""
    return (k.device.type == "cpu" and k.dtype == v.dtype == torch.float32 and k.dim() == 3 and k.shape == v.shape
            and k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == k.shape[2]
            and cpu_kernel_available())


def _i64(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def gather_entries(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, n: torch.Tensor,
                   ids_b: torch.Tensor | None = None, n_b: torch.Tensor | None = None,
                   bias_b: torch.Tensor | None = None, table_b: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV head ``h`` of pools ``k, v [Hkv, S, D]`` (a zero head stride: rows shared by the heads): the pool
    rows ``rows[h, :n[h]]`` (bias 0), then the extra entries ``ids_b[h, :n_b[h]]`` (entry ``e``: pool row
    ``table_b[h, e]``, or ``e`` without a table; bias ``bias_b[h, e]``; ``bias_b``, ``table_b``: ``[Hkv, M]``), then
    padding (pool row 0's key, a zero value, bias ``-inf``) up to ``rows``' width plus ``ids_b``'s. Returns keys
    and values ``[Hkv, W, D]`` and bias ``[Hkv, W]``, float32. Counts are clipped to their widths."""
    fn = _load()
    if fn is None:
        raise RuntimeError("the CPU gather-entries kernel is unavailable (see the log); use gather_entries_ref")
    hkv, s, d = k.shape
    if not gather_entries_usable(k, v) or rows.dim() != 2 or rows.shape[0] != hkv:
        raise ValueError(f"bad gather-entries input: k {tuple(k.shape)} {k.dtype}, rows {tuple(rows.shape)}")
    ra, na = _i64(rows), _i64(n.reshape(hkv))
    ib = nb = bb = tb = None
    wb = mb = 0
    if ids_b is not None and n_b is not None and bias_b is not None:
        ib, nb = _i64(ids_b), _i64(n_b.reshape(hkv))
        bb = bias_b if bias_b.dtype == torch.float32 and bias_b.is_contiguous() else bias_b.float().contiguous()
        tb = None if table_b is None else _i64(table_b)
        if ib.dim() != 2 or ib.shape[0] != hkv or bb.dim() != 2 or bb.shape[0] != hkv or (
                tb is not None and tb.shape != bb.shape):
            raise ValueError(f"ids_b {tuple(ib.shape)}, bias_b {tuple(bb.shape)} (and table_b) must be [Hkv={hkv}, *]")
        wb, mb = ib.shape[1], bb.shape[1]
    w = ra.shape[1] + wb
    kv = torch.empty(2, hkv, w, d)
    bias = torch.empty(hkv, w)
    rc = fn(k.data_ptr(), v.data_ptr(), k.stride(0), s, hkv, d, ra.data_ptr(), na.data_ptr(), ra.shape[1],
            0 if ib is None else ib.data_ptr(), 0 if nb is None else nb.data_ptr(), wb,
            0 if tb is None else tb.data_ptr(), 0 if bb is None else bb.data_ptr(), mb, kv[0].data_ptr(),
            kv[1].data_ptr(), bias.data_ptr())
    if rc:
        raise ValueError("gather-entries: a row lies outside the pool" if rc == 1 else
                         "gather-entries: an extra entry id lies outside its table")
    return kv[0], kv[1], bias


def attend_entries(q: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, bias: torch.Tensor, *, scale: float,
                   pseudo_logits: torch.Tensor | None = None, pseudo_values: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_decode_attention_torch``'s attention of rows ``q [B, Hq, D]`` over gathered entries ``kg, vg
    [B, Hkv, N, D]`` with ``bias [B, Hkv, N]`` (``-inf``: padding), plus pseudo-entries: the same ops, so the same
    float32 bits. Returns out ``[B, Hq, D]`` and lse ``[B, Hq]``."""
    b, hq, d = q.shape
    hkv = kg.shape[1]
    g = hq // hkv
    qg = (q if q.dtype == torch.float32 else q.float()).reshape(b, hkv, g, d)
    logits = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, N]
    logits.add_(bias.unsqueeze(2))
    pl = pseudo_logits.float().reshape(b, hkv, g, -1) if pseudo_logits is not None else None
    lse = torch.logsumexp(logits if pl is None else torch.cat([logits, pl], dim=-1), dim=-1)  # [B, Hkv, G]
    safe_lse = lse.nan_to_num(neginf=0.0).unsqueeze(-1)
    out = torch.matmul(logits.sub_(safe_lse).exp_(), vg)
    if pl is not None and pseudo_values is not None:
        w = (pl - safe_lse).exp_()
        pv = pseudo_values.float().reshape(b, hkv, g, -1, d)
        out.add_(torch.matmul(w.unsqueeze(-2), pv).squeeze(-2))
    return out.reshape(b, hq, d), lse.reshape(b, hq)
