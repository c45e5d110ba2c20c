"""Configuration of offloaded decode: tier budgets, verification and the SSD reader."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

READERS = ("auto", "posix", "kvikio")
DEVICE_PLANS = ("auto", "on", "off")


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
    io_depth: int = 32
    """Page reads in flight on the SSD path (POSIX reader: threads of a fetcher's read pool, one blocking
    ``preadv`` per coalesced run each): random 4-16 KiB reads reach an SSD's ceiling only with many queued."""
    io_threads: int = 4
    """Threads the keyed-CRC verification of a read spreads over (1: the calling thread)."""
    direct_io: bool = False
    """Open page files with ``O_DIRECT`` (bypass the OS page cache) where the file system allows."""
    pin_memory: bool | None = None
    """Page-lock host buffers (staging, host tier) for the GPU; None: when CUDA is available."""
    warm_host_fraction: float = 0.5
    """When a generation opens, load its whole prefix into the host tier (large sequential reads) if
    it takes at most this fraction of the tier (0: never); a warm prefix enables ``device_plan``."""
    warm_in_background: bool = True
    """Warm the prefix (``warm_host_fraction``) on a thread while the generation decodes, its steps served
    from SSD on demand meanwhile, and switch to ``device_plan`` once it is whole in the tier (False: warm
    before the first step)."""
    warm_chunk_bytes: int = 32 << 20
    """Bytes a warm-up reads, checks and inserts at a time (large sequential reads; a stop takes effect
    within one chunk)."""
    summary_cache_bytes: int = 1 << 30
    """Host memory for the parsed summaries and page-CRC tables of recently opened prefixes (LRU, one per
    worker; 0: read and parse them at every open). Used by the resident path too."""
    device_plan: str = "auto"
    """Fetch through the device-planned GPU page cache (no host work per fetch) when the prefix is whole
    in the host tier: ``auto`` (CUDA only), ``on`` (also on a CPU: tests), ``off``."""
    host_in_place: bool = True
    """On a CPU device, attend a prefix whole in the host tier where its pages lie (``HostPageView``: no copy
    into a page pool; the CPU's pool is main memory too). False: the page fetcher copies them (CUDA always
    does). ``device_plan="on"`` takes precedence."""

    def __post_init__(self) -> None:
        if self.gpu_cache_bytes <= 0:
            raise ValueError(f"gpu_cache_bytes must be positive, got {self.gpu_cache_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {self.reader!r}")
        if not 0 <= self.warm_host_fraction <= 1:
            raise ValueError(f"warm_host_fraction must be in [0, 1], got {self.warm_host_fraction}")
        if self.warm_chunk_bytes <= 0:
            raise ValueError(f"warm_chunk_bytes must be positive, got {self.warm_chunk_bytes}")
        if self.summary_cache_bytes < 0:
            raise ValueError(f"summary_cache_bytes must be >= 0, got {self.summary_cache_bytes}")
        if self.device_plan not in DEVICE_PLANS:
            raise ValueError(f"device_plan must be one of {DEVICE_PLANS}, got {self.device_plan!r}")
        if not 1 <= self.io_depth <= 256:
            raise ValueError(f"io_depth must be in [1, 256], got {self.io_depth}")
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in [1, 64], got {self.io_threads}")


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    """Command-line flags of ``OffloadConfig`` (defaults from the dataclass)."""
    d = OffloadConfig()
    g = parser.add_argument_group("offloaded decode")
    g.add_argument("--no-offload", action="store_true",
                   help="sparse methods read each layer once and hold it instead of fetching pages per step")
    g.add_argument("--gpu-cache-mb", type=int, default=d.gpu_cache_bytes >> 20,
                   help="GPU page cache of one generation, all layers (MiB)")
    g.add_argument("--host-cache-mb", type=int, default=d.host_cache_bytes >> 20,
                   help="pinned host tier shared by generations (MiB; 0: SSD -> GPU)")
    g.add_argument("--page-reader", choices=READERS, default=d.reader, help="SSD page reader")
    g.add_argument("--io-depth", type=int, default=d.io_depth, help="SSD page reads in flight per generation")
    g.add_argument("--io-threads", type=int, default=d.io_threads, help="threads of page CRC verification")
    g.add_argument("--no-verify-pages", action="store_true", help="skip the per-page CRC check of SSD reads")
    g.add_argument("--warm-host-fraction", type=float, default=d.warm_host_fraction,
                   help="load a whole prefix into the host tier when it takes at most this fraction of it")
    g.add_argument("--device-plan", choices=DEVICE_PLANS, default=d.device_plan,
                   help="device-planned GPU page cache for prefixes whole in the host tier")


def offload_from_args(args: argparse.Namespace) -> OffloadConfig | None:
    """The ``OffloadConfig`` the flags of ``add_offload_args`` describe (None with --no-offload)."""
    if args.no_offload:
        return None
    return OffloadConfig(gpu_cache_bytes=args.gpu_cache_mb << 20, host_cache_bytes=args.host_cache_mb << 20,
                         reader=args.page_reader, io_depth=args.io_depth, io_threads=args.io_threads,
                         verify=not args.no_verify_pages,
                         warm_host_fraction=args.warm_host_fraction, device_plan=args.device_plan)
