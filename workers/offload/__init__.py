"""Offloaded decode: fetch only the pages a selector picks, GPU page cache -> pinned host tier -> SSD.

``PageFetcher`` (one per generation) over a ``HostTier`` (one per worker), configured by
``OffloadConfig``; counters in ``OffloadStats``. See ``fetcher.py`` for the per-step flow.
``DevicePageCache`` (``device_plan.py``) is the sync-free, CUDA-graph-capturable fast path for a
prefix held whole in the host tier.
"""

from workers.offload.config import OffloadConfig
from workers.offload.device_plan import DeviceCacheStats, DevicePageCache, HostNotWarm
from workers.offload.fetcher import CacheTooSmall, PageFetcher
from workers.offload.gpu_cache import FetchResult
from workers.offload.host_tier import HostTier, PrefixHeld
from workers.offload.stats import OffloadStats, StepCounts

__all__ = ["CacheTooSmall", "DeviceCacheStats", "DevicePageCache", "FetchResult", "HostNotWarm", "HostTier",
           "OffloadConfig", "OffloadStats", "PageFetcher", "PrefixHeld", "StepCounts"]
