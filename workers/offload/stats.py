"""Per-step counters of offloaded decode: pages and bytes per tier, cache hits, read calls, phase times."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

PHASES = ("select", "fetch", "attend")


@dataclass(kw_only=True)
class StepCounts:
    """What the fetches of one decode step (all layers) moved."""

    pages: int = 0
    """Pages requested."""
    gpu_hits: int = 0
    """Served by the GPU page cache (no transfer)."""
    host_pages: int = 0
    """Copied host tier -> GPU."""
    ssd_pages: int = 0
    """Read from the page files."""

    def add(self, other: StepCounts) -> None:
        """Accumulate ``other``."""
        self.pages += other.pages
        self.gpu_hits += other.gpu_hits
        self.host_pages += other.host_pages
        self.ssd_pages += other.ssd_pages


@dataclass(kw_only=True)
class OffloadStats:
    """Counters of one generation's fetches; ``as_dict`` merges into ``GenerationStats.extra``.

    Bytes: ``bytes_gpu_hit`` and ``bytes_host`` count K+V payload (what attention reads / what crosses
    PCIe); ``bytes_ssd`` counts bytes read from disk (whole aligned pages).
    """

    payload_bytes: int
    """K+V bytes of one page (for byte counts)."""
    page_bytes: int
    """Bytes of one page in a page file."""
    total: StepCounts = field(default_factory=StepCounts)
    per_step: list[StepCounts] = field(default_factory=list)
    """Indexed by step: a layer's n-th fetch belongs to step n."""
    read_calls: int = 0
    """preadv calls or kvikio futures (one per coalesced run)."""
    gather_launches: int = 0
    gpu_evictions: int = 0
    overflow_fetches: int = 0
    """Fetches of more pages than a layer's GPU page cache holds (served from a one-off pool)."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Wall time per phase (``select``, ``fetch``, ``attend``, and any other name timed)."""
    sync_timing: bool = False
    """Synchronize the device around timed phases (exact GPU times; costs a sync per phase)."""

    def record(self, step: int, counts: StepCounts) -> None:
        """Add one fetch's counts to step ``step``."""
        while len(self.per_step) <= step:
            self.per_step.append(StepCounts())
        self.per_step[step].add(counts)
        self.total.add(counts)

    @property
    def steps(self) -> int:
        """Decode steps seen (most fetches of any layer)."""
        return len(self.per_step)

    @property
    def hit_rate(self) -> float:
        """Fraction of requested pages served by the GPU page cache."""
        return self.total.gpu_hits / self.total.pages if self.total.pages else 0.0

    @property
    def bytes_gpu_hit(self) -> int:
        """K+V bytes served from the GPU page cache."""
        return self.total.gpu_hits * self.payload_bytes

    @property
    def bytes_host(self) -> int:
        """K+V bytes copied host tier -> GPU."""
        return self.total.host_pages * self.payload_bytes

    @property
    def bytes_ssd(self) -> int:
        """Bytes read from page files."""
        return self.total.ssd_pages * self.page_bytes

    @contextlib.contextmanager
    def timed(self, phase: str, device: torch.device | None = None) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[phase]`` (device-synchronized when ``sync_timing``)."""
        sync = self.sync_timing and device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize(device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def as_dict(self, prefix: str = "offload_") -> dict[str, float]:
        """Flat float counters for ``GenerationStats.extra``."""
        d = {
            "steps": self.steps, "pages_requested": self.total.pages, "gpu_hits": self.total.gpu_hits,
            "host_pages": self.total.host_pages, "ssd_pages": self.total.ssd_pages, "hit_rate": self.hit_rate,
            "bytes_gpu_hit": self.bytes_gpu_hit, "bytes_host": self.bytes_host, "bytes_ssd": self.bytes_ssd,
            "read_calls": self.read_calls, "gather_launches": self.gather_launches,
            "gpu_evictions": self.gpu_evictions, "overflow_fetches": self.overflow_fetches,
            **{f"{k}_s": v for k, v in self.seconds.items()},
        }
        return {prefix + k: float(v) for k, v in d.items()}
