"""The CPU form of ``page_entries``: ``kernel.cpp`` through ctypes (built and cached like ``index_page_mass``'s
kernel; ``KVSTASH_CPU_KERNEL=0`` or no compiler keeps the torch reference). The same integers and bias as
``page_entries_ref`` in one call, plus the picked entries' pool rows and mid mask laid out for φ completion's
kernel (``PageEntries.mid_rows``, ``valid``)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from native.build import CpuKernelBuild, load_library

from .entries import PageEntries

__all__ = ["cpu_kernel_available", "page_entries_cpu"]

SOURCE = Path(__file__).with_name("kernel.cpp")


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> Any | None:
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="page_entries",
                       fallback="page entries with torch ops on the CPU")
    if lib is None:
        return None
    fn = lib.kvstash_page_entries
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = ([i64] * 4 + [ptr] + [i64] * 2 + [ptr] + [i64] * 2 + [ptr, i64, ptr] + [i64] * 4 + [ptr] * 6)
    fn.restype = ctypes.c_int
    return fn


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def page_entries_cpu(picked: torch.Tensor, first_rows: torch.Tensor, anchor_slot: torch.Tensor,
                     anchor_offset: torch.Tensor, *, page_size: int, lo: int, hi: int, pool_rows: int) -> PageEntries:
    """``page_entries`` of int64 CPU tensors (validated by the caller) on the kernel, with ``mid_rows`` and
    ``valid`` (each output its own ``torch.empty``: cheaper than views of one buffer)."""
    fn = _load()
    assert fn is not None, "page_entries_cpu needs the built kernel (cpu_kernel_available)"
    hkv, n = picked.shape
    na = anchor_slot.shape[0]
    np_, e = n * page_size, n * page_size + na
    i64 = torch.int64
    rows, tokens, mid_rows = torch.empty(1, hkv, e, dtype=i64), torch.empty(1, hkv, np_, dtype=i64), \
        torch.empty(1, hkv, np_, dtype=i64)
    bias, valid, count = torch.empty(1, hkv, e), torch.empty(1, hkv, np_, dtype=torch.bool), torch.empty((), dtype=i64)
    fn(hkv, n, page_size, na, picked.data_ptr(), picked.stride(0), picked.stride(1), first_rows.data_ptr(),
       first_rows.stride(0), first_rows.stride(1), anchor_slot.data_ptr(), anchor_slot.stride(0),
       anchor_offset.data_ptr(), anchor_offset.stride(0), lo, hi, pool_rows, rows.data_ptr(), bias.data_ptr(),
       tokens.data_ptr(), mid_rows.data_ptr(), valid.data_ptr(), count.data_ptr())
    return PageEntries(rows=rows, bias=bias, tokens=tokens, n_distinct=count, mid_rows=mid_rows, valid=valid)
