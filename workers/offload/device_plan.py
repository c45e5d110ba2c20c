"""The device-planned GPU page cache: a fetch with no host work, capturable in a CUDA graph.

For a generation whose prefix lies whole in the pinned host tier (``PageFetcher.warm_host``),
``DevicePageCache`` keeps all of its state on the GPU (page -> slot map, slot -> page, last-use
stamps, the host-tier row of every page: ``kernels.page_plan.PlanState``) and holds the prefix's host-tier
slots so they cannot be evicted while it reads them. ``fetch(layer, pages)`` issues two launches of
fixed shape and never waits for the device:

1. the plan (``kernels.page_plan``): lookup, hit stamps, LRU victims per KV head among a rotating
   window of its slots (head ``h`` owns ``slots_per_head`` slots, at least twice the pages of one call;
   the window holds at least twice the call's pages, so a hit is never a victim), map updates, and per
   entry the host row to copy (-1 for hits and padding) and the pool row to read;
2. one gather (``kernels.gather_pages``) over the call's ``Hkv * n`` entries that skips the -1 rows,
   reading mapped pinned host memory.

So select + fetch + attend of every layer of a decode step can be captured in one CUDA graph and
replayed per token. Hit / miss counters accumulate on the device; ``stats()`` reads them (a sync).

Fail closed: pages come only from host-tier rows, and a page enters the host tier only after the SSD
read that brought it passed its checks (sizes, short reads, keyed CRC with ``verify``). When the
precondition does not hold (no host tier, a page of the prefix not in it, no CUDA, or a host tier
the GPU cannot read in place) ``from_fetcher`` returns None and the caller keeps using the
``PageFetcher`` itself, which serves any tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from store.errors import InvalidInput
from store.layout import KVLayout
from workers.kernels.gather_pages import GatherConfig, gather_pages, triton_available
from workers.kernels.page_plan import WINDOW_MIN, PlanState, plan_pages
from workers.offload.fetcher import PageFetcher
from workers.offload.gpu_cache import FetchResult
from workers.offload.host_tier import HostTier

PLANS = ("auto", "triton", "torch")


class HostNotWarm(InvalidInput):
    """A page of the prefix is not in the host tier (warm it first, or use ``PageFetcher``)."""


@dataclass(frozen=True)
class DeviceCacheStats:
    """Counters of a ``DevicePageCache`` since it opened (all layers)."""

    fetches: int
    """``fetch`` calls."""
    hits: int
    """Requested pages served by the GPU page cache."""
    misses: int
    """Pages copied host tier -> GPU."""
    rejected: int
    """Page ids >= the prefix's pages (served as padding: row -1)."""
    payload_bytes: int
    """K+V bytes of one page."""

    @property
    def pages(self) -> int:
        """Pages requested (padding excluded)."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Fraction of requested pages served by the GPU page cache."""
        return self.hits / self.pages if self.pages else 0.0

    @property
    def bytes_host(self) -> int:
        """K+V bytes copied host -> GPU."""
        return self.misses * self.payload_bytes


class DevicePageCache:
    """GPU page cache of one generation, planned on the device (see the module docstring).

    Parameters
    ----------
    host : HostTier
        Holds every page of the prefix under keys ``layer * Hkv * n_pages + head * n_pages + page``
        (as ``PageFetcher`` inserts them); held (not evictable) until ``close``.
    pages_per_call : int
        P, the most page ids per KV head of one ``fetch``.
    slots_per_head : int, optional
        Page slots per KV head and layer (>= 2P; default 4P).
    plan : str
        ``triton`` (one launch; default on CUDA), ``torch`` (~20 ops; default elsewhere), or ``auto``.
    gather : GatherConfig, optional
        Tuning of the Triton gather (default ``GatherConfig()``).
    plan_warps : int
        Warps of the Triton plan's program per head (0: chosen from the slot count).
    window_min : int
        Fewest slots per head a plan searches for its victims (``PlanState.window``; tests set it low).
    """

    def __init__(self, host: HostTier, prefix_id: str, layout: KVLayout, n_tokens: int,
                 device: torch.device | str, *, pages_per_call: int, slots_per_head: int | None = None,
                 plan: str = "auto", gather: GatherConfig | None = None, plan_warps: int = 0,
                 window_min: int = WINDOW_MIN):
        self.layout, self.prefix_id, self.n_tokens = layout, prefix_id, n_tokens
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.n_pages = layout.n_pages(n_tokens)
        p = pages_per_call
        s = 4 * p if slots_per_head is None else slots_per_head
        if p < 1 or s < 2 * p:
            raise ValueError(f"need pages_per_call >= 1 and slots_per_head >= 2 * pages_per_call, got {p}, {s}")
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        cuda = self.device.type == "cuda"
        self.plan = ("triton" if cuda and triton_available() else "torch") if plan == "auto" else plan
        self.use_triton_gather = cuda and triton_available()
        self.gather = gather or GatherConfig()
        self.plan_warps = plan_warps
        lay, heads = layout, layout.n_kv_heads
        keys = np.arange(lay.n_layers * heads * self.n_pages, dtype=np.int64)
        slots = host.hold(prefix_id, keys)
        if slots is None:
            raise HostNotWarm(f"prefix {prefix_id} is not whole in the host tier; warm it or use PageFetcher")
        self.host = host
        self._held: np.ndarray | None = slots
        self.pages_per_call, self.slots_per_head = p, s
        try:
            rows = torch.from_numpy(slots).view(lay.n_layers, heads, self.n_pages).to(self.device)
            self.state = PlanState.empty(host_rows=rows, slots_per_head=s, pages_per_call=p,
                                         page_size=lay.page_size, window_min=window_min)
            pool_rows = heads * s * lay.page_size
            self.k = [torch.zeros(pool_rows, lay.head_dim, dtype=lay.torch_dtype, device=self.device)
                      for _ in range(lay.n_layers)]
            self.v = [torch.zeros_like(k) for k in self.k]
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_fetcher(cls, fetcher: PageFetcher, *, pages_per_call: int, slots_per_head: int | None = None,
                     plan: str = "auto", allow_cpu: bool = False, gather: GatherConfig | None = None,
                     plan_warps: int = 0, window_min: int = WINDOW_MIN) -> DevicePageCache | None:
        """A cache over ``fetcher``'s prefix and host tier, or None when the fast path's precondition does
        not hold (then use ``fetcher``). ``slots_per_head`` defaults to the fetcher's GPU budget per head,
        ``gather`` to the fetcher's gather tuning. ``allow_cpu``: also on a CPU device (tests; no speed to
        gain)."""
        host = fetcher.host
        if host is None or (fetcher.device.type != "cuda" and not allow_cpu):
            return None
        if fetcher.device.type == "cuda" and not host.pinned:
            return None
        if slots_per_head is None:
            slots_per_head = fetcher.slots_per_layer // fetcher.layout.n_kv_heads
            if slots_per_head < 2 * pages_per_call:
                raise ValueError(f"the GPU page cache holds {slots_per_head} pages per head and layer; the "
                                 f"device-planned cache needs >= {2 * pages_per_call}: raise gpu_cache_bytes")
        try:
            cache = cls(host, fetcher.prefix_id, fetcher.layout, fetcher.n_tokens, fetcher.device,
                        pages_per_call=pages_per_call, slots_per_head=slots_per_head, plan=plan,
                        gather=gather or fetcher.gather, plan_warps=plan_warps, window_min=window_min)
        except HostNotWarm:
            return None
        if not cache._probe_gather():
            cache.close()
            return None
        return cache

    # -- public API ------------------------------------------------------------------------------
    def fetch(self, layer: int, pages: torch.Tensor) -> FetchResult:
        """Make pages ``[Hkv, n]`` (``n <= pages_per_call``; ids per KV head, unique per head, -1 padding;
        on this device) of ``layer`` resident. No sync, fixed shapes: capturable in a CUDA graph.

        The result's ``rows [Hkv, n]`` is each page's first pool row (-1: padding, or an id >= the prefix's
        pages, counted as ``rejected``); valid until the next fetch of the layer. A duplicate id is served
        correctly but takes a slot per copy.
        """
        heads = self.layout.n_kv_heads
        if not 0 <= layer < self.layout.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {self.layout.n_layers})")
        if pages.dim() != 2 or pages.shape[0] != heads or not 1 <= pages.shape[1] <= self.pages_per_call:
            raise InvalidInput(f"pages must be [{heads}, n] with 1 <= n <= {self.pages_per_call}, "
                               f"got {tuple(pages.shape)}")
        if pages.device != self.device or pages.dtype not in (torch.int32, torch.int64):
            raise InvalidInput(f"pages must be int32/int64 on {self.device}, got {pages.dtype} on {pages.device}")
        pages = pages.to(torch.int64).contiguous()
        st = self.state
        plan_pages(st, layer, pages, use_triton=self.plan == "triton", num_warps=self.plan_warps)
        m = heads * pages.shape[1]  # the plan's outputs: this call's entries only (a short call gathers little)
        gather_pages(self.host.pages, st.src_rows[layer, :m], self.k[layer], self.v[layer], st.dst_slots[layer, :m],
                     block_bytes=self.layout.block_bytes, use_triton=self.use_triton_gather, skip_negative=True,
                     config=self.gather)
        return self.result(layer, pages.shape[1])

    def result(self, layer: int, n: int | None = None) -> FetchResult:
        """The pools of ``layer`` as attention reads them (rows of the last fetch's first ``n`` entries)."""
        lay, k, v = self.layout, self.k[layer], self.v[layer]
        rows = k.shape[0]
        h = lay.n_kv_heads
        return FetchResult(k=k.unsqueeze(0).expand(h, rows, lay.head_dim),
                           v=v.unsqueeze(0).expand(h, rows, lay.head_dim),
                           slot_map=self.state.page_to_slot[layer, :, : self.n_pages], page_size=lay.page_size,
                           n_tokens=self.n_tokens, extra_base=rows, n_extra=0,
                           rows=self.state.rows[layer, :, : n or self.pages_per_call])

    def stats(self) -> DeviceCacheStats:
        """The device counters (one device -> host copy: call between steps, not inside a graph)."""
        c = self.state.counters.sum(dim=(0, 1)).tolist()
        return DeviceCacheStats(fetches=int(self.state.clock[:, 0].sum().item()), hits=c[0], misses=c[1],
                                rejected=c[2], payload_bytes=self.layout.page_payload_bytes)

    def check(self) -> None:
        """Raise InvalidInput when a fetch was given page ids outside the prefix (they were served as
        padding); a sync."""
        bad = self.stats().rejected
        if bad:
            raise InvalidInput(f"{bad} page ids >= {self.n_pages} (the prefix has {self.n_tokens} tokens)")

    @property
    def gpu_bytes(self) -> int:
        """Bytes of the K/V pools of all layers."""
        return sum(2 * k.numel() * k.element_size() for k in self.k)

    def close(self) -> None:
        """Wait for the device's reads of the host tier, then release its slots and the pools."""
        if self._held is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host.release(self._held)
        self._held = None
        self.k, self.v = [], []

    def __enter__(self) -> DevicePageCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _probe_gather(self) -> bool:
        """Whether the gather can read the host tier in place (a launch that copies nothing)."""
        if not self.use_triton_gather:
            return True
        src = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        try:
            gather_pages(self.host.pages, src, self.k[0], self.v[0], torch.zeros_like(src),
                         block_bytes=self.layout.block_bytes, use_triton=True, skip_negative=True,
                         config=self.gather)
        except ValueError as e:
            if "cannot be accessed" not in str(e):
                raise
            return False
        return True
