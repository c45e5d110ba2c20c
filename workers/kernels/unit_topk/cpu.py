"""The CPU form of ``top_units``: ``kernel.cpp`` through ctypes (built and cached like ``index_page_mass``'s kernel;
``KVSTASH_CPU_KERNEL=0`` or no compiler keeps the torch reference). ``top_units_ref``'s ids exactly (the k highest,
ties to the lower id, ascending) in one call instead of two sorts."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from native.build import CpuKernelBuild, load_library

__all__ = ["cpu_kernel_available", "top_units_cpu", "top_units_usable"]

SOURCE = Path(__file__).with_name("kernel.cpp")


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> Any | None:
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="unit_topk",
                       fallback="the unit top-k sorts with torch on the CPU")
    if lib is None:
        return None
    fn = lib.kvstash_top_units
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr]
    fn.restype = ctypes.c_int
    return fn


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def top_units_usable(scores: torch.Tensor) -> bool:
    """Whether ``top_units_cpu`` takes these scores (float32 ``[R, U]`` on the CPU) and the kernel is built."""
    return scores.is_cpu and scores.dtype == torch.float32 and scores.dim() == 2 and cpu_kernel_available()


def top_units_cpu(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``top_units_ref(scores, k)`` of float32 CPU scores ``[R, U]`` (no NaN) on the kernel: ``[R, min(k, U)]``
    int64."""
    fn = _load()
    assert fn is not None, "top_units_cpu needs the built kernel (cpu_kernel_available)"
    r, u = scores.shape
    k = max(0, min(k, u))
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(r, k, dtype=torch.int64)
    fn(scores.data_ptr(), r, u, scores.stride(0), k, out.data_ptr())
    return out
