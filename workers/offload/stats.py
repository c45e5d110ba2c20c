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
class PrefetchCounts:
    """Layer-ahead prefetch: SSD pages read into the host tier off the critical path, and how well the
    predicted page sets matched the real ones. ``offload_ssd_pages`` stays what the real fetches read."""

    jobs: int = 0
    """Prefetch reads started (each one coalesced read + check of one layer's predicted pages)."""
    pages: int = 0
    """Pages a prefetch read from SSD, checked and put into the host tier."""
    useful: int = 0
    """Prefetched pages a real fetch then asked for and found in the host tier (SSD reads it did not make)."""
    dropped: int = 0
    """Prefetch requests not carried out: queue full, more pages than half the host tier, or cancelled
    because the real fetch came first (it reads the pages itself)."""
    no_room: int = 0
    """Prefetch reads whose pages did not fit beside the host tier's current batch (not inserted)."""
    errors: int = 0
    """Prefetch reads that failed (I/O, size or CRC): nothing was inserted; the real fetch reads and checks."""
    waits: int = 0
    """Real fetches that waited for a prefetch still reading pages they needed."""
    wait_s: float = 0.0
    """Time real fetches spent waiting for those."""
    read_s: float = 0.0
    """Time the prefetch thread spent reading and checking (off the critical path)."""
    predicted_pages: int = 0
    """Mid-region (head, page) pairs predicted for the next layer (summed over predictions)."""
    selected_pages: int = 0
    """Mid-region (head, page) pairs the next layer's selector then really picked (same steps)."""
    matched_pages: int = 0
    """Pairs both predicted and picked: recall = matched / selected, precision = matched / predicted."""

    def as_dict(self) -> dict[str, float]:
        """Flat counters (``prefetch_*``), with the predictions' recall and precision."""
        d = {f"prefetch_{k}": float(v) for k, v in vars(self).items()}
        d["prefetch_recall"] = self.matched_pages / self.selected_pages if self.selected_pages else 0.0
        d["prefetch_precision"] = self.matched_pages / self.predicted_pages if self.predicted_pages else 0.0
        return d


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
    prefetch: PrefetchCounts | None = None
    """Layer-ahead prefetch (``PageFetcher.prefetch``) and the predictions that fed it; None until the
    fetcher's first prefetch (then ``offload_prefetch_*`` counters are reported)."""
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
        if self.prefetch is not None:
            d.update(self.prefetch.as_dict())
            # SSD page reads moved off the critical path, of all SSD page reads the steps needed
            moved = self.prefetch.useful + self.total.ssd_pages
            d["prefetch_moved_fraction"] = self.prefetch.useful / moved if moved else 0.0
        return {prefix + k: float(v) for k, v in d.items()}
