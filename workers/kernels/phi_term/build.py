"""Loads ``kernel.cpp`` through ctypes, built once per machine and cached by ``native.build`` (its
``CpuKernelBuild``: the compiler, flags, cache directory and ``KVSTASH_CPU_KERNEL=0`` switch are shared)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from native.build import CpuKernelBuild, load_library

SOURCE = Path(__file__).with_name("kernel.cpp")


@functools.cache
def load(config: CpuKernelBuild | None = None) -> Any | None:
    """The library (entry points typed), built on first use; None (logged once) when disabled or it cannot be
    built, so callers keep the torch path."""
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="phi_term",
                       fallback="φ completion runs torch ops on the CPU")
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.kvstash_phi_mlp.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr]
    lib.kvstash_phi_mlp.restype = ctypes.c_int
    lib.kvstash_phi_pack.argtypes = [i64] * 4 + [ptr] + [i64] * 3 + [ptr] * 5 + [i64] + [ptr] * 2
    lib.kvstash_phi_pack.restype = i64
    lib.kvstash_phi_term.argtypes = ([i64] * 9 + [ptr] + [i64] * 3 + [ptr] * 12 + [f32, f32, ptr, ptr])
    lib.kvstash_phi_term.restype = ctypes.c_int
    lib.kvstash_phi_step.argtypes = ([i64] * 9 + [ptr] + [i64] * 3 + [ptr] + [i64] * 3 + [ptr] * 13
                                     + [f32, f32, ptr, ptr])
    lib.kvstash_phi_step.restype = ctypes.c_int
    return lib
