"""Which fetch engine a generation uses: the device-planned cache when its prefix is warm, else the fetcher.

Per ``OffloadConfig``: a prefix that fits ``warm_host_fraction`` of the host tier is loaded into it
whole when the generation opens (large sequential reads, each page CRC-checked); a prefix whole in
the host tier gets a ``DevicePageCache`` (fetches planned on the GPU, no host work). Steps whose
pages do not fit one call of it, and prefixes that are not warm, use the ``PageFetcher``.
"""

from __future__ import annotations

from workers.offload.config import OffloadConfig
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher


def warm_if_it_fits(fetcher: PageFetcher, config: OffloadConfig) -> int:
    """Load the whole prefix into the host tier when the policy allows; returns the bytes read."""
    host = fetcher.host
    if host is None or config.warm_host_fraction <= 0:
        return 0
    prefix_bytes = fetcher.layout.n_layers * fetcher.n_keys * fetcher.layout.page_bytes
    if prefix_bytes > config.warm_host_fraction * host.budget_bytes:
        return 0
    return fetcher.warm_host()


def open_device_cache(fetcher: PageFetcher, config: OffloadConfig) -> DevicePageCache | None:
    """A device-planned cache over ``fetcher``'s (warm) prefix, or None (then the fetcher serves)."""
    if config.device_plan == "off":
        return None
    lay = fetcher.layout
    per_head = config.gpu_cache_bytes // lay.n_layers // lay.page_payload_bytes // lay.n_kv_heads
    # Its exact LRU needs two slots per page of a call: a call takes up to half the head's budget.
    pages_per_call = min(fetcher.n_pages, per_head // 2)
    if pages_per_call < 1:
        return None
    return DevicePageCache.from_fetcher(fetcher, pages_per_call=pages_per_call, slots_per_head=2 * pages_per_call,
                                        allow_cpu=config.device_plan == "on")
