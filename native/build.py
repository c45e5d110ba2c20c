"""Builds a C++ kernel source with the machine's C++ compiler once per machine (cached) and loads it through ctypes.

ctypes rather than a torch C++ extension: the kernel needs no torch headers, so a build is one ``g++`` call of
about a second instead of the 30-60 s ``torch.utils.cpp_extension`` spends compiling torch's and pybind's
headers, and it needs no ninja. ``-march=native`` is safe because the cache key holds the CPU's feature flags: a
cache directory shared by different machines keeps one build per kind of CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("KVSTASH_KERNEL_CACHE", Path(base) / "kvstash" / "cpu_kernels"))


@dataclass(frozen=True)
class CpuKernelBuild:
    """How the CPU kernel is compiled and where the build is cached."""

    compiler: str = field(default_factory=lambda: os.environ.get("CXX", "g++"))
    """The C++ compiler (``$CXX``, else ``g++``)."""
    flags: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-pthread")
    """``-fopenmp-simd``: only the vectorization pragmas, no OpenMP runtime (torch brings its own)."""
    cache_dir: Path = field(default_factory=_default_cache_dir)
    """Where built libraries are kept (``$KVSTASH_KERNEL_CACHE``, else ``~/.cache/kvstash/cpu_kernels``)."""
    enabled: bool = field(default_factory=lambda: os.environ.get("KVSTASH_CPU_KERNEL", "1") != "0")
    """``KVSTASH_CPU_KERNEL=0`` keeps each caller's fallback path (torch, numpy or Python; for comparisons)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(config: CpuKernelBuild, compiler: str, source: Path) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    h = hashlib.sha256()
    for part in (source.read_bytes(), compiler.encode(), version.encode(), " ".join(config.flags).encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(config: CpuKernelBuild, *, source: Path, name: str) -> Path:
    """The built library's path: the cached one, else compiled now (raises when the compiler is missing or
    fails). ``source``: the kernel's C++ file; ``name``: its library's name in the cache."""
    compiler = shutil.which(config.compiler)
    if compiler is None:
        raise FileNotFoundError(f"C++ compiler {config.compiler!r} not found")
    lib = config.cache_dir / f"{name}-{_build_key(config, compiler, source)}.so"
    if lib.exists():
        return lib
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=config.cache_dir)
    os.close(fd)
    try:
        t0 = time.perf_counter()
        done = subprocess.run([compiler, *config.flags, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{config.compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: processes building at once each leave a complete library
        log.info("built the CPU %s kernel in %.1f s: %s", name, time.perf_counter() - t0, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_LOCK = threading.Lock()


def load_library(config: CpuKernelBuild, *, source: Path, name: str, fallback: str) -> ctypes.CDLL | None:
    """A CPU kernel's library, built on first use; None (logged) when disabled or it cannot be built. ``fallback``
    says what the caller does instead (for the log)."""
    if not config.enabled:
        log.info("CPU %s kernel disabled (KVSTASH_CPU_KERNEL=0): %s", name, fallback)
        return None
    with _LOCK:  # threads of one process: one build
        try:
            return ctypes.CDLL(str(build(config, source=source, name=name)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("CPU %s kernel unavailable (%s): %s", name, e, fallback)
            return None
