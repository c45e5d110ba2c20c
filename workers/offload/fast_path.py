"""Which fetch engine a generation uses: the device-planned cache when its prefix is warm, else the fetcher.

Per ``OffloadConfig``: a prefix that fits ``warm_host_fraction`` of the host tier is loaded into it
whole (large sequential reads, each page CRC-checked); a prefix whole in the host tier gets a
``DevicePageCache`` (fetches planned on the GPU, no host work); on a CPU device, a ``HostPageView``
instead (its pages attended where they lie in the host tier). Steps whose pages do not fit one call
of the device-planned cache, and prefixes that are not warm, use the ``PageFetcher``.

Fast open (``warm_in_background``): the warm-up runs on a thread and decoding starts at once, each
step's pages coming from the host tier where the warm-up (or an earlier step) put them and from SSD
otherwise. The generation polls ``FastOpen.poll`` at its steps; the first poll after the warm-up
finished opens the device-planned cache (or the host view), and later steps use it. A warm-up that failed on a corrupt
page fails the generation at its next poll, as a warm-up before the first step would have.
"""

from __future__ import annotations

from store.errors import CorruptData
from workers.offload.config import OffloadConfig
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher
from workers.offload.host_view import HostPageView


def warm_fits(fetcher: PageFetcher, config: OffloadConfig) -> bool:
    """Whether the policy loads ``fetcher``'s whole prefix into its host tier."""
    host = fetcher.host
    if host is None or config.warm_host_fraction <= 0:
        return False
    prefix_bytes = fetcher.layout.n_layers * fetcher.n_keys * fetcher.layout.page_bytes
    return prefix_bytes <= config.warm_host_fraction * host.budget_bytes


def warm_if_it_fits(fetcher: PageFetcher, config: OffloadConfig) -> int:
    """Load the whole prefix into the host tier now when the policy allows; returns the bytes read."""
    return fetcher.warm_host() if warm_fits(fetcher, config) else 0


def open_device_cache(fetcher: PageFetcher, config: OffloadConfig) -> DevicePageCache | None:
    """A device-planned cache over ``fetcher``'s (warm) prefix, or None (then the fetcher serves)."""
    if config.device_plan == "off":
        return None
    lay = fetcher.layout
    per_head = config.gpu_cache_bytes // lay.n_layers // lay.page_payload_bytes // lay.n_kv_heads
    # Its LRU needs two slots per page of a call (a hit is never a victim): a call takes up to half the head's
    # budget.
    pages_per_call = min(fetcher.n_pages, per_head // 2)
    if pages_per_call < 1:
        return None
    return DevicePageCache.from_fetcher(fetcher, pages_per_call=pages_per_call, slots_per_head=2 * pages_per_call,
                                        allow_cpu=config.device_plan == "on")


def open_host_view(fetcher: PageFetcher, config: OffloadConfig) -> HostPageView | None:
    """A view attending ``fetcher``'s (warm) prefix in the host tier, or None (not a CPU device, not allowed, or
    not warm: then the fetcher serves)."""
    if not config.host_in_place or config.device_plan == "on":
        return None
    return HostPageView.from_fetcher(fetcher)


class FastOpen:
    """Opens a generation's fetch engines over ``fetcher``'s prefix (see the module docstring).

    ``device_cache`` is the device-planned cache when it opened at once (warm-up before the first step,
    or the prefix already warm); otherwise ``poll`` opens it once the background warm-up has finished.
    ``host_view`` likewise, on a CPU device (``poll_view``). The caller owns what it gets (closes it before the
    fetcher); ``fetcher.close`` stops the warm-up.
    """

    def __init__(self, fetcher: PageFetcher, config: OffloadConfig):
        self.fetcher, self.config = fetcher, config
        self.device_cache: DevicePageCache | None = None
        self.host_view: HostPageView | None = None
        self._pending = False
        if not warm_fits(fetcher, config):
            return
        if not config.warm_in_background:
            fetcher.warm_host()
        elif self._open():
            return  # already whole in the tier (an earlier generation warmed it)
        else:
            fetcher.warm_host_in_background()
            self._pending = True
            return
        self._open()

    def _open(self) -> bool:
        """Open the engine of a warm prefix: the device-planned cache, else (CPU) the host view; whether one did."""
        if self.config.device_plan != "off":
            self.device_cache = open_device_cache(self.fetcher, self.config)
        if self.device_cache is None:
            self.host_view = open_host_view(self.fetcher, self.config)
        return self.device_cache is not None or self.host_view is not None

    def poll(self) -> DevicePageCache | None:
        """The device-planned cache once the background warm-up has finished (opened by the first call
        after it did; None before, or when it cannot open). Raises the warm-up's CorruptData."""
        self._finish()
        return self.device_cache

    def poll_view(self) -> HostPageView | None:
        """The host view once the background warm-up has finished (as ``poll``)."""
        self._finish()
        return self.host_view

    def _finish(self) -> None:
        """After the background warm-up has finished: open the engines (once); raise its CorruptData."""
        warm = self.fetcher.warmup
        if not self._pending or warm is None or warm.running:
            return
        self._pending = False
        if isinstance(warm.error, CorruptData):
            raise CorruptData(str(warm.error)) from warm.error
        if warm.done:
            self._open()
