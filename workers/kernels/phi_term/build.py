"""Builds ``kernel.cpp`` once per machine (cached) and loads it through ctypes, as ``index_page_mass`` does (its
``CpuKernelBuild``: the compiler, flags, cache directory and ``KVSTASH_CPU_KERNEL=0`` switch are shared)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from workers.kernels.index_page_mass.build import CpuKernelBuild, _cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")


def _build_key(config: CpuKernelBuild, compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), version.encode(), " ".join(config.flags).encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(config: CpuKernelBuild) -> Path:
    """The built library's path: the cached one, else compiled now (raises when the compiler is missing or
    fails)."""
    compiler = shutil.which(config.compiler)
    if compiler is None:
        raise FileNotFoundError(f"C++ compiler {config.compiler!r} not found")
    lib = config.cache_dir / f"phi_term-{_build_key(config, compiler)}.so"
    if lib.exists():
        return lib
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=config.cache_dir)
    os.close(fd)
    try:
        t0 = time.perf_counter()
        done = subprocess.run([compiler, *config.flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{config.compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: processes building at once each leave a complete library
        log.info("built the CPU φ-term kernel in %.1f s: %s", time.perf_counter() - t0, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_LOCK = threading.Lock()


@functools.cache
def load(config: CpuKernelBuild | None = None) -> Any | None:
    """The library (entry points typed), built on first use; None (logged once) when disabled or it cannot be
    built, so callers keep the torch path."""
    config = config or CpuKernelBuild()
    if not config.enabled:
        log.info("CPU kernels disabled (KVSTASH_CPU_KERNEL=0): φ completion runs torch ops on the CPU")
        return None
    with _LOCK:
        try:
            lib = ctypes.CDLL(str(build(config)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("CPU φ-term kernel unavailable (%s): φ completion runs torch ops on the CPU", e)
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
