"""Offloaded decode: fetch only the pages a selector picks, GPU page cache -> pinned host tier -> SSD.

``PageFetcher`` (one per generation) over a ``HostTier`` (one per worker), configured by
``OffloadConfig``; counters in ``OffloadStats``. See ``fetcher.py`` for the per-step flow.
"""

from workers.offload.config import OffloadConfig
from workers.offload.fetcher import CacheTooSmall, PageFetcher
from workers.offload.gpu_cache import FetchResult
from workers.offload.host_tier import HostTier
from workers.offload.stats import OffloadStats, StepCounts

__all__ = ["CacheTooSmall", "FetchResult", "HostTier", "OffloadConfig", "OffloadStats", "PageFetcher", "StepCounts"]
