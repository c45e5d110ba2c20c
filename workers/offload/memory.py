"""Host buffers for offloaded decode: 4 KiB aligned (``O_DIRECT``), page-locked and GPU-mapped on CUDA.

Pinned buffers are an anonymous ``mmap`` registered with ``cudaHostRegister``: exact size (torch's
pinned allocator rounds up to a power of two) and, with unified addressing, mapped so a GPU kernel
can read them directly. Where registration is unavailable, torch's pinned allocator is used.
"""

from __future__ import annotations

import mmap

import torch

ALIGN = 4096
REGISTER_PORTABLE, REGISTER_MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for the GPU; False when this torch/CUDA cannot."""
    try:
        cudart = torch.cuda.cudart()
        for flags in (REGISTER_PORTABLE | REGISTER_MAPPED, 0):
            if int(getattr(err := cudart.cudaHostRegister(t.data_ptr(), t.numel(), flags), "value", err)) == 0:
                return True
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
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False

    def __del__(self) -> None:
        self.close()


def pin_default(pin: bool | None) -> bool:
    """Resolve ``OffloadConfig.pin_memory``: None -> whether CUDA is available."""
    return torch.cuda.is_available() if pin is None else pin
