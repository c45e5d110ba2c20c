"""Launcher of the CPU token-rows kernel (``kernel.cpp``): a step's token ids -> host-view pool rows, and the
distinct pages they read.

``token_rows`` gives what ``HostPageView.token_rows`` computes in numpy (``token_rows_ref``): each id's pool row
(``-1`` for ids outside the prefix) and the number of distinct (KV head, page) pairs of the valid entries, in
one pass instead of some ten array ops and a sort.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from native.build import CpuKernelBuild, load_library

__all__ = ["cpu_kernel_available", "page_rows", "token_rows"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")


@functools.cache
def _lib(config: CpuKernelBuild | None = None) -> Any | None:
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="token_rows",
                       fallback="the host view maps token rows in numpy")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvstash_token_rows.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr]
    lib.kvstash_token_rows.restype = i64
    lib.kvstash_page_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr]
    lib.kvstash_page_rows.restype = i64
    return lib


def _load(config: CpuKernelBuild | None = None) -> Any | None:
    lib = _lib(config)
    return None if lib is None else lib.kvstash_token_rows


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def token_rows(tokens: torch.Tensor, counts: torch.Tensor, first_rows: torch.Tensor, page_size: int,
               n_tokens: int) -> tuple[torch.Tensor, int]:
    """Token ids ``tokens [..., Hkv, n]`` (int64, CPU), of which the first ``counts [..., Hkv]`` per row are valid,
    and ``first_rows [Hkv, n_pages]`` int64 (each page's first pool row) -> (pool rows ``[..., Hkv, n]`` int64:
    ``first_rows[h, t // page_size] + t % page_size``, ``-1`` for ids outside ``[0, n_tokens)``; the number of
    distinct (head, page) pairs of the valid ids). Raises ``ValueError`` when a valid id lies outside the prefix."""
    fn = _load()
    if fn is None:
        raise RuntimeError("the CPU token-rows kernel is unavailable (see the log); use token_rows_ref")
    hkv, n_pages = first_rows.shape
    if tokens.shape[-2] != hkv or counts.shape != tokens.shape[:-1] or first_rows.dtype != torch.int64:
        raise ValueError(f"bad token-rows input: tokens {tuple(tokens.shape)}, counts {tuple(counts.shape)}, "
                         f"first_rows {tuple(first_rows.shape)} {first_rows.dtype}")
    t = tokens if tokens.dtype == torch.int64 and tokens.is_contiguous() else tokens.to(torch.int64).contiguous()
    c = counts if counts.dtype == torch.int64 and counts.is_contiguous() else counts.to(torch.int64).contiguous()
    fr = first_rows if first_rows.is_contiguous() else first_rows.contiguous()
    out = torch.empty(t.shape, dtype=torch.int64)
    n = t.shape[-1]
    distinct = fn(t.data_ptr(), c.data_ptr(), c.numel(), hkv, n, fr.data_ptr(), n_pages, page_size, n_tokens,
                  out.data_ptr())
    if distinct < 0:
        raise ValueError(f"token ids must lie in [0, {n_tokens})")
    return out, distinct


def page_rows(pages: torch.Tensor, first_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Page ids ``pages [Hkv, n]`` (int64, CPU, any strides; negative: padding) and ``first_rows [Hkv, n_pages]``
    int64 contiguous -> (pool rows ``[Hkv, n]`` int64: ``first_rows[h, page]``, ``-1`` for padding; the number of
    distinct (head, page) pairs of the ids >= 0): ``HostPageView.page_rows``' numpy in one call. Raises
    ``ValueError`` when an id is ``>= n_pages``."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU token-rows kernel is unavailable (see the log); use numpy")
    fn = lib.kvstash_page_rows
    hkv, n_pages = first_rows.shape
    if pages.dim() != 2 or pages.shape[0] != hkv or pages.dtype != torch.int64 or not first_rows.is_contiguous():
        raise ValueError(f"bad page-rows input: pages {tuple(pages.shape)} {pages.dtype}, first_rows "
                         f"{tuple(first_rows.shape)}")
    out = torch.empty(pages.shape, dtype=torch.int64)
    distinct = fn(pages.data_ptr(), pages.stride(0), pages.stride(1), hkv, pages.shape[1],
                            first_rows.data_ptr(), n_pages, out.data_ptr())
    if distinct < 0:
        raise ValueError(f"page ids must be < {n_pages}")
    return out, distinct
