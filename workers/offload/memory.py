"""Host buffers for offloaded decode: 4 KiB aligned (``O_DIRECT``), page-locked and GPU-mapped on CUDA.

Pinned buffers are an anonymous ``mmap`` registered with ``cudaHostRegister``: exact size (torch's
pinned allocator rounds up to a power of two) and, with unified addressing, mapped so a GPU kernel
can read them directly. Where registration is unavailable, torch's pinned allocator is used.
"""

from __future__ import annotations

import logging
import mmap
import threading

import torch

log = logging.getLogger(__name__)

ALIGN = 4096
REGISTER_PORTABLE, REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped


_DEFERRED: list[tuple[int, mmap.mmap]] = []
"""Registered mappings whose unregistering failed or had to wait (a CUDA graph capture was running: a synchronizing
call there fails, and would break the capture): kept mapped until unregistered, so that no later mapping at the
same address is refused as already registered."""
_DEFERRED_LOCK = threading.Lock()


def _code(err: object) -> int:
    return int(getattr(err, "value", err))  # type: ignore[call-overload]


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


def _unregister(ptr: int) -> bool:
    """Unregister a mapping now, unless a capture is running; True when done."""
    if _capturing():
        return False
    try:
        return _code(torch.cuda.cudart().cudaHostUnregister(ptr)) == 0
    except (AttributeError, RuntimeError, AssertionError):
        return False


def _retry_deferred() -> None:
    with _DEFERRED_LOCK:
        _DEFERRED[:] = [(ptr, m) for ptr, m in _DEFERRED if not _unregister(ptr)]


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for the GPU; False when this torch/CUDA cannot."""
    _retry_deferred()
    try:
        cudart = torch.cuda.cudart()
        for flags in (REGISTER_PORTABLE | REGISTER_MAPPED, 0):
            if (code := _code(cudart.cudaHostRegister(t.data_ptr(), t.numel(), flags))) == 0:
                return True
            log.warning("cudaHostRegister of %d bytes (flags %d) failed with CUDA error %d; using torch's pinned "
                        "allocator", t.numel(), flags, code)
    except (AttributeError, RuntimeError, AssertionError):
        return False
    return False


class HostBuffer:
    """``nbytes`` of host memory as a uint8 tensor (``.tensor``); ``close`` unpins it."""

    def __init__(self, nbytes: int, *, pin: bool):
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self._registered = False
        self.pinned = False
        self._map: mmap.mmap | None = mmap.mmap(-1, size)
        t = torch.frombuffer(self._map, dtype=torch.uint8)
        if pin:
            self._registered = _register(t)
            if not self._registered:
                self._map = None
                t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.pinned = True
        self.tensor = t[:nbytes]

    def close(self) -> None:
        """Unpin (if registered); the memory stays valid while tensors view it."""
        if self._registered:
            self._registered = False
            ptr = self.tensor.data_ptr()
            if not _unregister(ptr) and self._map is not None:  # e.g. garbage collected during a graph capture
                with _DEFERRED_LOCK:
                    _DEFERRED.append((ptr, self._map))

    def __del__(self) -> None:
        self.close()


def pin_default(pin: bool | None) -> bool:
    """Resolve ``OffloadConfig.pin_memory``: None -> whether CUDA is available."""
    return torch.cuda.is_available() if pin is None else pin
