"""Loads ``kernel.cpp`` through ctypes, built with the machine's C++ compiler once per machine and cached
(``native.build``: the compiler, flags, cache and ``KVSTASH_CPU_KERNEL=0`` switch every CPU kernel shares).

ctypes rather than a torch C++ extension: the kernel needs no torch headers, so a build is one ``g++`` call of
about a second instead of the 30-60 s ``torch.utils.cpp_extension`` spends compiling torch's and pybind's
headers, and it needs no ninja.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from native.build import CpuKernelBuild, load_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")
SYMBOL = "kvstash_index_page_mass"


@dataclass(frozen=True)
class Loaded:
    """The built kernel: its entry point, and whether the build has the AVX-512 paths (the measured fast ones)."""

    fn: Any
    avx512: bool


@functools.cache
def load(config: CpuKernelBuild | None = None) -> Loaded | None:
    """The kernel, built on first use; None (logged once) when disabled or it cannot be built, so callers keep
    the torch path."""
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="index_page_mass",
                       fallback="Top-K scores with torch on the CPU")
    if lib is None:
        return None
    fn = getattr(lib, SYMBOL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 5 + [i64] * 13 + [ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    avx512 = bool(lib.kvstash_index_page_mass_avx512())
    if not avx512:
        log.info("CPU index page-mass kernel built without AVX-512 (this CPU or compiler lacks it): no faster than "
                 "torch here, so Top-K scores with torch on the CPU")
    return Loaded(fn, avx512)
