"""Every page's keyed CRC-32 over a run of page-file bytes in one call: ``page_crc.cpp`` through ctypes (built once
per machine by ``native.build``; a ctypes call releases the GIL, so writer threads and a GPU forward pass run on
meanwhile), else the Python loop over ``store.pages.page_crc`` (no compiler, or ``KVSTASH_CPU_KERNEL=0``). The
values are the same either way: ``page_crc(prefix_id, layer, head, page, payload)``.

A 128k-token prefill at Llama-3.1-8B's shape has 2M pages: one Python call per page held the GIL for 16
core-seconds; the kernel takes one call per run of pages and computes the seeds itself.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import numpy as np

from native.build import CpuKernelBuild, load_library
from store.pages import page_crc

SOURCE = Path(__file__).with_name("page_crc.cpp")


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> Any | None:
    lib = load_library(config or CpuKernelBuild(), source=SOURCE, name="page_crc",
                       fallback="page CRCs one Python call per page")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvstash_page_crcs.argtypes = [ctypes.c_char_p] + [i64] * 6 + [ptr, ptr]
    lib.kvstash_page_crcs.restype = ctypes.c_int
    lib.kvstash_crc32.argtypes = [ctypes.c_uint32, ptr, i64]
    lib.kvstash_crc32.restype = ctypes.c_uint32
    lib.kvstash_crc32_clmul.restype = ctypes.c_int
    return lib


def native_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def _as_rows(data: np.ndarray | memoryview | bytes | bytearray, page_bytes: int) -> np.ndarray:
    """``data`` as C-contiguous ``uint8 [count, page_bytes]`` (no copy when it is already)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8 or arr.size % max(page_bytes, 1):
        raise ValueError(f"page bytes must be uint8 whole pages of {page_bytes} bytes, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr).reshape(-1, page_bytes)


def page_crcs(prefix_id: str, layer: int, n_pages: int, first: int, data: np.ndarray | memoryview | bytes | bytearray,
              page_bytes: int, *, native: bool = True) -> np.ndarray:
    """Keyed CRCs ``uint32 [count]`` of the consecutive pages in ``data`` (``count * page_bytes`` bytes), the
    first of them at linear index ``first`` (``head * n_pages + page``) of layer ``layer``. ``native=False``:
    the Python loop (what runs without the kernel)."""
    rows = _as_rows(data, page_bytes)
    count = rows.shape[0]
    out = np.empty(count, dtype=np.uint32)
    lib = _load() if native else None
    if lib is None:
        for i in range(count):
            head, page = divmod(first + i, n_pages)
            out[i] = page_crc(prefix_id, layer, head, page, memoryview(rows[i]))
        return out
    key = prefix_id.encode()
    if lib.kvstash_page_crcs(key, len(key), layer, n_pages, first, count, page_bytes, rows.ctypes.data,
                             out.ctypes.data):
        raise ValueError(f"page CRCs: arguments out of range (prefix id of {len(key)} bytes, layer {layer}, "
                         f"{n_pages} pages, first {first})")
    return out


def crc32(data: np.ndarray | memoryview | bytes, value: int = 0) -> int:
    """zlib's ``crc32(data, value)`` computed by the kernel (its tests compare the two); needs the kernel."""
    lib = _load()
    if lib is None:
        raise RuntimeError("the page CRC kernel is not available (native_available)")
    arr = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data)
    return int(lib.kvstash_crc32(value & 0xFFFFFFFF, arr.ctypes.data, arr.nbytes))


def folds_with_clmul() -> bool:
    """Whether the built kernel folds with carry-less multiplies (else slicing-by-8 tables only)."""
    lib = _load()
    return lib is not None and bool(lib.kvstash_crc32_clmul())
