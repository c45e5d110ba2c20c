"""Read access to one stored prefix at decode time: whole layers, per-step layer views, artifacts."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from store.artifacts import bytes_to_tensors
from store.kvstore import KVStore
from store.layout import KVLayout
from store.manifest import Manifest
from store.pages import unpack_pages
from workers.methods.layer_kv import FetchedKV, LayerKV, ResidentKV
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher
from workers.offload.host_view import HostPageView
from workers.offload.streamed_summary import StreamedArtifact
from workers.offload.summaries import SummaryCache


class PrefixSource:
    """Read access to one stored prefix on one device, counting the bytes it reads.

    With a ``fetcher`` (offloaded decode), sparse methods fetch per step only the pages they attend;
    without one, they read each layer once and hold it.
    """

    def __init__(self, store: KVStore, manifest: Manifest, device: torch.device, *, verify: bool = True,
                 fetcher: PageFetcher | None = None, device_cache: DevicePageCache | None = None,
                 summaries: SummaryCache | None = None):
        self.store, self.manifest, self.device = store, manifest, device
        self.summaries = summaries
        """The worker's cache of parsed artifacts (None: read and parse them here)."""
        self.verify = verify
        """Check each page's keyed CRC on read: corrupt or misplaced bytes fail the request, never decode."""
        self.fetcher = fetcher
        self.device_cache = device_cache
        """Device-planned fetches of a warm prefix (steps that fit it; the fetcher serves the rest)."""
        self.switch: Callable[[], DevicePageCache | None] | None = None
        """Polled at steps while ``device_cache`` is None: the device-planned cache once a background
        warm-up made the prefix warm (``workers.offload.fast_path.FastOpen.poll``)."""
        self.host_view: HostPageView | None = None
        """On a CPU device: the warm prefix's pages attended in the host tier (steps the device cache does not
        serve)."""
        self.view_switch: Callable[[], HostPageView | None] | None = None
        """Polled at steps while ``host_view`` is None, as ``switch`` (``FastOpen.poll_view``)."""
        self.bytes_read = 0
        self.stream_summaries = False
        """Hand out summaries as they are read (``artifact_streamed``): only for a caller that verifies them before
        anything derived from them goes out (the worker's engine does, when the query is in)."""
        self.artifact_s = 0.0
        """Seconds spent getting artifacts: read, checked and parsed (or found in the summary cache), then
        copied to the device (a device copy from pageable memory is synchronous); for a streamed one, starting
        its read and parsing its header."""

    def shared_key(self, name: str) -> tuple[str, str, str] | None:
        """Key under which the generations over this prefix on this device may share read-only state derived
        from artifact ``name`` (its digest: the same bytes, whichever store or prefix holds them); None when
        the prefix has no such artifact."""
        info = self.manifest.artifact(name)
        return None if info is None else (name, info.blake2b, str(self.device))

    @property
    def layout(self) -> KVLayout:
        """The prefix's KV layout."""
        return self.manifest.layout

    @property
    def n_tokens(self) -> int:
        """Tokens in the prefix."""
        return self.manifest.n_tokens

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one layer's K, V ``[kv_heads, n_tokens, head_dim]`` on the device."""
        k, v = self.host_layer_kv(layer)
        return k.to(self.device), v.to(self.device)

    def host_layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer_kv`` on the host: read from the layer's page file (checked when ``verify``), counted as read."""
        k, v = self.store.read_layer(self.manifest.prefix_id, layer, manifest=self.manifest, verify=self.verify)
        self.bytes_read += 2 * k.numel() * k.element_size()
        return k, v

    def whole_layer(self, layer: int, *, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer_kv``, but through the generation's tiers when it has a fetcher (the pinned host tier, shared
        across generations, serves a hot prefix; counted in the fetcher's stats under ``step``)."""
        if self.fetcher is None:
            return self.layer_kv(layer)
        k, v = self.fetcher.read_layer(layer, step=step)
        self.bytes_read += 2 * k.numel() * k.element_size()
        return k, v

    def last_token_kv(self) -> torch.Tensor:
        """``[layers, 2, kv_heads, head_dim]`` on the device: every layer's K and V of the prefix's last token
        (one page per layer and KV head read, checked like any page)."""
        lay, m = self.layout, self.manifest
        page, row = divmod(m.n_tokens - 1, lay.page_size)
        crcs = self.store.page_crcs(m.prefix_id, m) if self.verify else None
        raw = torch.empty(lay.n_kv_heads, lay.page_bytes, dtype=torch.uint8)
        out = torch.empty(lay.n_layers, 2, lay.n_kv_heads, lay.head_dim, dtype=lay.torch_dtype)
        for layer in range(lay.n_layers):
            for head in range(lay.n_kv_heads):
                self.store.read_pages(m.prefix_id, layer, head, [page], raw[head:head + 1], verify=self.verify,
                                      manifest=m, crcs=crcs)
            k, v = unpack_pages(lay, raw)  # [kv_heads, page_size, head_dim]
            out[layer, 0], out[layer, 1] = k[:, row], v[:, row]
        self.bytes_read += raw.numel() * lay.n_layers
        return out.to(self.device)

    def current_device_cache(self) -> DevicePageCache | None:
        """``device_cache``, opened through ``switch`` when the prefix has become warm since."""
        if self.device_cache is None and self.switch is not None:
            self.device_cache = self.switch()
        return self.device_cache

    def current_host_view(self) -> HostPageView | None:
        """``host_view``, opened through ``view_switch`` when the prefix has become warm since."""
        if self.host_view is None and self.view_switch is not None:
            self.host_view = self.view_switch()
        return self.host_view

    def layer(self, layer: int) -> LayerKV:
        """Decode-time access to one layer: fetched per step through the fetcher, else read and held."""
        if self.fetcher is not None:
            return FetchedKV(self.fetcher, layer, read_layer=self.layer_kv, device_cache=self.current_device_cache,
                             host_view=self.current_host_view)
        return ResidentKV(*self.layer_kv(layer), page_size=self.layout.page_size)

    def artifact_streamed(self, name: str) -> Mapping[str, torch.Tensor] | StreamedArtifact:
        """An artifact's tensors on the device: as ``artifact`` unless ``stream_summaries`` and the summary cache
        lacks them; then each tensor as its bytes arrive, the whole verified by ``StreamedArtifact.verify``."""
        if not self.stream_summaries:
            return self.artifact(name)
        t0 = time.perf_counter()
        try:
            cache = self.summaries
            if cache is not None and (cached := cache.cached_tensors(self.manifest, name)) is not None:
                return self._copies(name, cached)
            read = self.store.artifact_read(self.manifest.prefix_id, name, manifest=self.manifest)
            self.bytes_read += read.size
            manifest = self.manifest
            return StreamedArtifact(read, self.device, None if cache is None else
                                    lambda tensors: cache.add_tensors(manifest, name, tensors))
        finally:
            self.artifact_s += time.perf_counter() - t0

    def artifact(self, name: str) -> dict[str, torch.Tensor]:
        """An artifact's tensors (checksum-verified) on the device."""
        t0 = time.perf_counter()
        try:
            if self.summaries is None:
                data = self.store.artifact(self.manifest.prefix_id, name)
                self.bytes_read += len(data)
                return {k: t.to(self.device) for k, t in bytes_to_tensors(data).items()}
            return self._copies(name, self.summaries.tensors(self.store, self.manifest, name))
        finally:
            self.artifact_s += time.perf_counter() - t0

    def count_hit(self, name: str) -> None:
        """Count artifact ``name``'s bytes as read though a faster tier served them (the summary cache, or the
        state another generation shares): a generation's reads do not depend on what else runs."""
        info = self.manifest.artifact(name)
        self.bytes_read += info.size if info is not None else 0

    def _copies(self, name: str, cached: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The summary cache's tensors of artifact ``name`` copied to the device (callers may modify theirs), its
        bytes counted as read."""
        self.count_hit(name)
        return {k: t.to(self.device, copy=True) for k, t in cached.items()}
