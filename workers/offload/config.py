"""Configuration of offloaded decode: tier budgets, verification and the SSD reader."""

from __future__ import annotations

from dataclasses import dataclass

READERS = ("auto", "posix", "kvikio")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How a worker fetches the pages its selectors pick (one per worker; unknown keys are errors)."""

    gpu_cache_bytes: int = 1 << 30
    """GPU page cache of one generation, all layers together (split evenly per layer); K and V
    payload bytes. Must hold at least one step's pages of a layer."""
    host_cache_bytes: int = 4 << 30
    """Pinned host tier shared by the generations of open prefixes (0: no host tier, SSD -> GPU)."""
    verify: bool = True
    """Check each page read from SSD against its keyed CRC (prefix, layer, head, page). Sizes and
    short reads are always checked."""
    reader: str = "auto"
    """SSD reader: ``auto`` (kvikio when it imports and the device is CUDA, else POSIX), ``posix``,
    ``kvikio``."""
    io_threads: int = 4
    """Threads the POSIX reader and CRC verification spread a step's reads over (1: caller only)."""
    direct_io: bool = False
    """Open page files with ``O_DIRECT`` (bypass the OS page cache) where the file system allows."""
    pin_memory: bool | None = None
    """Page-lock host buffers (staging, host tier) for the GPU; None: when CUDA is available."""

    def __post_init__(self) -> None:
        if self.gpu_cache_bytes <= 0:
            raise ValueError(f"gpu_cache_bytes must be positive, got {self.gpu_cache_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {self.reader!r}")
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in [1, 64], got {self.io_threads}")
