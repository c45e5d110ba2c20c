"""Fetch the pages a selector picks, per (layer, step): GPU page cache -> pinned host tier -> page files.

One ``PageFetcher`` per generation. ``fetch(layer, pages)`` (or ``fetch_tokens``) makes every
requested page resident in the layer's GPU page cache and returns a ``FetchResult`` whose pools
the sparse attention kernel reads through ``idx`` rows (``FetchResult.token_rows``). Per call:

1. one device -> host copy of the request; numpy planning (exact LRU, no per-page Python);
2. GPU-cache misses are looked up in the host tier; host misses are read from the layer file in
   coalesced runs (one ``preadv`` / kvikio future per run) into a staging buffer, checked (sizes,
   short reads, keyed CRC when ``verify``) and inserted into the host tier;
3. one gather launch copies every missing page host -> GPU slots (reading mapped pinned memory);
   a second only when SSD pages did not fit in the host tier.

Any failure raises ``CorruptData`` (or ``InvalidInput``) and empties the layer's GPU cache, so
nothing half-written is ever attended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from store.errors import CorruptData, InvalidInput
from store.kvstore import KVStore
from store.manifest import Manifest
from store.page_io import PageCheck, PageReader, open_page_reader, read_checked
from workers.kernels.gather_pages import GatherConfig, gather_pages
from workers.offload.config import OffloadConfig
from workers.offload.gpu_cache import FetchResult, LayerCache
from workers.offload.host_tier import HostTier
from workers.offload.memory import HostBuffer, pin_default
from workers.offload.stats import OffloadStats, StepCounts
from workers.offload.summaries import SummaryCache
from workers.offload.warmup import HostWarmup
from workers.pages import page_mask


class CacheTooSmall(InvalidInput):
    """One step asked for more pages of a layer than its GPU page cache holds."""


class PageFetcher:
    """Tiered page fetch for one generation over one stored prefix (see the module docstring)."""

    def __init__(self, store: KVStore, manifest: Manifest, device: torch.device | str,
                 config: OffloadConfig | None = None, host: HostTier | None = None, *,
                 reader: PageReader | None = None, gather: GatherConfig | None = None,
                 summaries: SummaryCache | None = None):
        self.config = cfg = config or OffloadConfig()
        self.device = torch.device(device)
        self.manifest, self.prefix_id, self.layout = manifest, manifest.prefix_id, manifest.layout
        lay = self.layout
        self.n_tokens, self.n_pages = manifest.n_tokens, lay.n_pages(manifest.n_tokens)
        self.n_keys = lay.n_kv_heads * self.n_pages
        budget_slots = cfg.gpu_cache_bytes // lay.n_layers // lay.page_payload_bytes
        if budget_slots < 1:
            raise InvalidInput(f"gpu_cache_bytes {cfg.gpu_cache_bytes} holds no page per layer "
                               f"({lay.n_layers} layers x {lay.page_payload_bytes} B)")
        self.slots_per_layer = min(budget_slots, self.n_keys)
        """GPU page-cache slots per layer: the budget's share, never more than the layer has pages."""
        self._paths, self._sizes = self._files(store, manifest)
        self._crcs = None
        if cfg.verify and summaries is not None:
            self._crcs = summaries.page_crcs(store, manifest)
        elif cfg.verify:
            self._crcs = store.page_crcs(self.prefix_id, manifest)
        self.host = host
        if host is not None:
            if host.page_bytes != lay.page_bytes:
                raise ValueError(f"host tier pages are {host.page_bytes} B, this prefix's {lay.page_bytes} B")
            host.open_prefix(self.prefix_id, lay.n_layers * self.n_keys)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda and pin_default(cfg.pin_memory)
        # One pool serves both: io_depth reads in flight, io_threads CRC chunks (threads start on demand).
        workers = max(cfg.io_depth, cfg.io_threads)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstash-io") if workers > 1 else None
        self.reader = reader or open_page_reader(cfg.reader, cuda=self.cuda, pool=self._pool, depth=cfg.io_depth,
                                                 direct=cfg.direct_io)
        self._staging: HostBuffer | None = None
        self._staging_pages = 0
        self._layers: dict[int, LayerCache] = {}
        self._fetches: dict[int, int] = {}
        self._event: torch.cuda.Event | None = None
        self._index: HostBuffer | None = None
        self._head_base = (np.arange(lay.n_kv_heads, dtype=np.int64) * self.n_pages)[:, None]
        self.gather_mode = "triton" if self.cuda else "torch"
        self.gather = gather or GatherConfig()
        """Tuning of the Triton gather (results do not depend on it)."""
        self.stats = OffloadStats(payload_bytes=lay.page_payload_bytes, page_bytes=lay.page_bytes)
        self.warmup: HostWarmup | None = None
        """The background warm-up of this prefix into the host tier, once started."""

    def _files(self, store: KVStore, m: Manifest) -> tuple[list[Path], list[int]]:
        want = m.layout.layer_file_bytes(m.n_tokens)
        if len(m.files) != m.layout.n_layers or any(f.size != want for f in m.files):
            raise CorruptData(f"manifest of prefix {m.prefix_id} lists page files that do not match its layout")
        return [store.prefix_dir(m.prefix_id) / f.name for f in m.files], [f.size for f in m.files]

    # -- public API ------------------------------------------------------------------------------
    def fetch(self, layer: int, pages: torch.Tensor, *, step: int | None = None) -> FetchResult:
        """Make pages ``[Hkv, n]`` (ids per KV head, any device; -1 = padding) of ``layer`` resident.

        The result's ``rows [Hkv, n]`` gives each requested page's first row in the pools. ``step``
        files the counts under that decode step (default: the layer's n-th fetch is step n).
        """
        with self.stats.timed("fetch", self.device):
            keys, lin = self._page_keys(pages)
            return self._fetch_keys(layer, keys, lin, step=step)

    def fetch_tokens(self, layer: int, tokens: torch.Tensor, counts: torch.Tensor, *,
                     step: int | None = None, overflow: bool = False, one_off: bool = False) -> FetchResult:
        """Fetch the pages of the first ``counts`` token ids of each row of ``tokens [..., Hkv, n]``
        (counts ``[..., Hkv]``; rows of a step are merged); token ids outside the prefix raise.
        ``step``: as for ``fetch``. More pages than the layer's GPU page cache holds raise
        ``CacheTooSmall`` unless ``overflow``: then they go to a one-off pool (over the GPU budget for
        this call only; counted in ``stats.overflow_fetches``). ``one_off``: every page goes to a pool of
        their size dropped with the result, and the layer keeps no GPU page cache (a layer whose steps a
        device-planned cache serves: a second cache beside it would double the generation's device memory)."""
        with self.stats.timed("fetch", self.device):
            keys = self._token_keys(tokens, counts)
            if not one_off:
                return self._fetch_keys(layer, keys, step=step, overflow=overflow)
            if keys.size > self.slots_per_layer:  # the same bound as the layer's cache would set
                if not overflow:
                    raise self._too_small(layer, int(keys.size), self.slots_per_layer)
                self.stats.overflow_fetches += 1
            self._release_layer(layer)
            return self._fetch_keys(layer, keys, step=step, cache=self._one_off_cache(max(1, int(keys.size))))

    def _release_layer(self, layer: int) -> None:
        """Drop ``layer``'s GPU page cache, if it has one (its results keep their pools while referenced)."""
        if layer in self._layers:
            self._wait_own()
            del self._layers[layer]

    def read_layer(self, layer: int, *, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All of ``layer``'s K, V ``[Hkv, N, D]`` on the device, every page fetched through the tiers.

        The pages go to a one-off pool, not the layer's GPU page cache: a whole-layer read (a query-time
        cache's query step) must not stay on the device after its caller drops it, nor evict the pages
        per-step fetches reuse. ``step``: as for ``fetch``.
        """
        lay = self.layout
        with self.stats.timed("fetch", self.device):
            cache = self._one_off_cache(self.n_keys)
            res = self._fetch_keys(layer, np.arange(self.n_keys, dtype=np.int64), step=step, cache=cache)
            tokens = torch.arange(self.n_tokens, device=self.device).expand(lay.n_kv_heads, -1)
            rows = res.token_rows(tokens)  # every page was fetched: all rows valid
            return cache.k[rows], cache.v[rows]

    def set_extra_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Per-head extra entries ``[Hkv, M, D]`` (e.g. Double-P centroids) in ``layer``'s pools."""
        self._wait_own()
        self._layer(layer).set_extra(k.to(self.device), v.to(self.device))

    def warm_host(self, layers: Iterable[int] | None = None) -> int:
        """Load every page of ``layers`` (default all) into the host tier with large sequential reads;
        returns the bytes read (pages already there are skipped)."""
        if self.host is None or self.host.n_slots == 0:
            return 0
        return HostWarmup(self, layers=layers).run()

    def warm_host_in_background(self) -> HostWarmup | None:
        """Start loading the whole prefix into the host tier on a thread while this fetcher serves steps
        (None without a host tier). ``close`` stops it."""
        if self.host is None or self.host.n_slots == 0:
            return None
        if self.warmup is None:
            self.warmup = HostWarmup(self).start()
        return self.warmup

    def page_file(self, layer: int) -> tuple[Path, int]:
        """Path and size (as the manifest recorded it) of ``layer``'s page file."""
        return self._paths[layer], self._sizes[layer]

    def page_check(self, layer: int) -> PageCheck | None:
        """What reads of ``layer`` are verified against (None with ``verify`` off)."""
        if self._crcs is None:
            return None
        return PageCheck(prefix_id=self.prefix_id, layer=layer, n_pages=self.n_pages, crcs=self._crcs[layer])

    def close(self) -> None:
        """Stop a background warm-up; release files, threads, staging and GPU pools."""
        if self.warmup is not None:
            self.warmup.stop()
        self._wait_own()
        if self.host is not None:
            self.host.forget_reader(id(self))
        self.reader.close()
        if self._pool is not None:
            self._pool.shutdown()
        for buf in (self._staging, self._index):
            if buf is not None:
                buf.close()
        self._layers.clear()

    def __enter__(self) -> PageFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _page_keys(self, pages: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Page ids ``[Hkv, n]`` -> (sorted unique linear keys, linear id per request entry, -1 padding)."""
        p = pages.detach().to("cpu", torch.int64).numpy()
        h = self.layout.n_kv_heads
        if p.ndim != 2 or p.shape[0] != h:
            raise InvalidInput(f"pages must be [{h}, n] page ids per KV head, got {tuple(p.shape)}")
        if p.size and p.max() >= self.n_pages:
            raise InvalidInput(f"page ids must be < {self.n_pages} (the prefix has {self.n_tokens} tokens)")
        lin = np.where(p >= 0, self._head_base + p, -1).reshape(-1)
        keys = np.sort(lin[lin >= 0])
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))] if keys.size else keys
        return keys, lin

    def _token_keys(self, tokens: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
        """Sorted linear keys of the pages of the first ``counts [..., Hkv]`` ids of ``tokens [..., Hkv, n]``."""
        mask, outside = page_mask(tokens, counts, self.n_tokens, self.layout.page_size)
        flat = torch.cat([mask.reshape(-1), (outside > 0).reshape(1)]).cpu().numpy()  # one copy
        if flat[-1]:
            raise InvalidInput(f"token ids must lie in [0, {self.n_tokens})")
        return np.flatnonzero(flat[:-1])

    def _layer(self, layer: int) -> LayerCache:
        if not 0 <= layer < self.layout.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {self.layout.n_layers})")
        if layer not in self._layers:
            lay = self.layout
            self._layers[layer] = LayerCache(n_slots=self.slots_per_layer, n_heads=lay.n_kv_heads,
                                             n_pages=self.n_pages, n_tokens=self.n_tokens, page_size=lay.page_size,
                                             head_dim=lay.head_dim, dtype=lay.torch_dtype, device=self.device)
        return self._layers[layer]

    def _fetch_keys(self, layer: int, keys: np.ndarray, lin: np.ndarray | None = None, *,
                    step: int | None = None, overflow: bool = False, cache: LayerCache | None = None) -> FetchResult:
        """Make sorted unique linear keys resident; ``lin`` (request order, -1 padding) -> result rows.

        ``cache``: a one-off pool to fill instead of the layer's GPU page cache (it must hold every key).
        Any failure empties the layer's cache before it propagates: nothing half-written is served.
        """
        if cache is None:
            cache = self._layer(layer)
        elif not 0 <= layer < self.layout.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {self.layout.n_layers})")
        if keys.size > cache.n_slots and overflow:
            cache = self._overflow_cache(layer, int(keys.size))
        elif keys.size > cache.n_slots:
            raise self._too_small(layer, int(keys.size), cache.n_slots)
        if step is None:
            step = self._fetches.get(layer, 0)
        self._fetches[layer] = step + 1
        counts = StepCounts(pages=int(keys.size))
        st = self.stats
        with self.host.lock if self.host is not None else contextlib.nullcontext():
            try:
                with st.timed("plan"):
                    slots, where_miss, evicted = self._plan(cache, keys, counts)
                groups: list[tuple[torch.Tensor, bool]] = []
                parts: list[np.ndarray] = []
                if where_miss.size:
                    miss, dst = keys[where_miss], slots[where_miss]
                    with st.timed("sources"):
                        for src, pinned, rows, to in self._sources(layer, miss, dst, counts):
                            groups.append((src, pinned))
                            parts += [rows, to]
                    parts.append(np.concatenate([evicted, miss, np.full(evicted.size, -1, np.int64), dst]))
                if lin is not None:
                    at = slots[np.minimum(np.searchsorted(keys, lin), keys.size - 1)] if keys.size else lin
                    parts.append(np.where(lin >= 0, at * self.layout.page_size, -1))
                with st.timed("to_device"):
                    dev = self._to_device(parts)
                with st.timed("launch"):
                    self._launch(cache, dev, groups)
            except BaseException:
                cache.invalidate()
                raise
        st.record(step, counts)
        return cache.result(dev[-1].view(self.layout.n_kv_heads, -1) if lin is not None else None)

    def _too_small(self, layer: int, n_keys: int, n_slots: int) -> CacheTooSmall:
        return CacheTooSmall(f"a step asked for {n_keys} pages of layer {layer} but its GPU page cache holds "
                             f"{n_slots}; raise OffloadConfig.gpu_cache_bytes to at least "
                             f"{n_keys * self.layout.page_payload_bytes * self.layout.n_layers} bytes")

    def _one_off_cache(self, n_slots: int) -> LayerCache:
        """An empty cache of ``n_slots`` for one fetch (dropped with its result)."""
        lay = self.layout
        return LayerCache(n_slots=n_slots, n_heads=lay.n_kv_heads, n_pages=self.n_pages, n_tokens=self.n_tokens,
                          page_size=lay.page_size, head_dim=lay.head_dim, dtype=lay.torch_dtype, device=self.device)

    def _overflow_cache(self, layer: int, n_slots: int) -> LayerCache:
        """A one-off cache of ``n_slots`` for one oversized fetch, with the layer's extra entries."""
        main, lay = self._layer(layer), self.layout
        tmp = self._one_off_cache(n_slots)
        if main.n_extra:
            base = main.n_slots * lay.page_size
            shape = (lay.n_kv_heads, main.n_extra, lay.head_dim)
            tmp.set_extra(main.k[base:].view(shape), main.v[base:].view(shape))
        self.stats.overflow_fetches += 1
        return tmp

    def _plan(self, cache: LayerCache, keys: np.ndarray, counts: StepCounts
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """LRU lookup, touch, and slots for the misses: (slots of keys, positions of misses, evicted keys)."""
        lru = cache.lru
        lru.begin_batch()
        slots = lru.tables[0][keys]
        hit = slots >= 0
        lru.stamp[slots[hit]] = lru.tick
        counts.gpu_hits = int(np.count_nonzero(hit))
        where_miss = np.flatnonzero(~hit)
        evicted = np.zeros(0, dtype=np.int64)
        if where_miss.size:
            alloc = lru.allocate(0, keys[where_miss])
            slots[where_miss] = alloc.slots
            evicted = alloc.evicted_keys
            self.stats.gpu_evictions += int(evicted.size)
        return slots, where_miss, evicted

    def _sources(self, layer: int, miss: np.ndarray, dst: np.ndarray, counts: StepCounts
                 ) -> list[tuple[torch.Tensor, bool, np.ndarray, np.ndarray]]:
        """Where each missing page comes from: (source pages, pinned, source rows, destination slots).

        Host-tier pages are read in place; SSD pages are read into staging, checked and put into the
        host tier (then read from there), or served from staging when they do not fit in it.
        """
        if self.host is None:
            self._read(layer, miss)
            counts.ssd_pages = int(miss.size)
            return [(self._staging_tensor(miss.size), self.pin, np.arange(miss.size, dtype=np.int64), dst)]
        self.host.begin_batch()
        hkeys = layer * self.n_keys + miss
        src = self.host.lookup(self.prefix_id, hkeys)
        cold = src < 0
        counts.ssd_pages = int(np.count_nonzero(cold))
        counts.host_pages = int(miss.size) - counts.ssd_pages
        groups = []
        if counts.ssd_pages:
            buf = self._read(layer, miss[cold])
            put = self.host.insert(self.prefix_id, hkeys[cold], buf)
            if put is None:  # does not fit beside this batch: serve the SSD pages from staging
                groups.append((self._staging_tensor(buf.shape[0]), self.pin, np.arange(buf.shape[0], dtype=np.int64),
                               dst[cold]))
                src, dst = src[~cold], dst[~cold]
            else:
                src[cold] = put
        if src.size:
            groups.append((self.host.pages, self.host.pinned, src, dst))
        return groups

    def _read(self, layer: int, keys: np.ndarray) -> np.ndarray:
        """Read pages ``keys`` (sorted linear ids) of ``layer`` into staging rows ``[0, n)``, checked."""
        buf = self._staging_rows(keys.size)
        check = self.page_check(layer)
        done = read_checked(self.reader, self._paths[layer], self._sizes[layer], keys, self.layout.page_bytes, buf,
                            check, pool=self._pool, threads=self.config.io_threads)
        self.stats.read_calls += done.calls
        sec = self.stats.seconds
        sec["ssd_read"] = sec.get("ssd_read", 0.0) + done.read_s
        if check is not None:
            sec["verify"] = sec.get("verify", 0.0) + done.verify_s
        return buf

    def _staging_rows(self, n: int) -> np.ndarray:
        self._wait_own()  # a pending gather may still read the staging buffer
        if n > self._staging_pages:
            if self._staging is not None:
                self._staging.close()
            self._staging_pages = max(n, 2 * self._staging_pages)
            self._staging = HostBuffer(self._staging_pages * self.layout.page_bytes, pin=self.pin)
        return self._staging_tensor(n).numpy()

    def _staging_tensor(self, n: int) -> torch.Tensor:
        assert self._staging is not None
        return self._staging.tensor[: n * self.layout.page_bytes].view(n, self.layout.page_bytes)

    def _to_device(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """One host -> device copy of every index array of a fetch (through a pinned buffer on CUDA)."""
        sizes = [a.size for a in parts]
        flat = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
        if not self.cuda:
            return list(torch.from_numpy(flat).split(sizes))
        self._wait_own()  # the previous copy out of the pinned buffer has finished
        if self._index is None or self._index.tensor.numel() < flat.nbytes:
            self._index = HostBuffer(max(flat.nbytes, 2 * (self._index.tensor.numel() if self._index else 0), 1 << 16),
                                     pin=True)
        host = self._index.tensor[: flat.nbytes].view(torch.int64)
        host.numpy()[:] = flat
        return list(host.to(self.device, non_blocking=True).split(sizes))

    def _launch(self, cache: LayerCache, dev: list[torch.Tensor], groups: list[tuple[torch.Tensor, bool]]) -> None:
        """Gather launches (one per source group), then the device map update; records the fetch's event."""
        if groups:
            for i, (src, pinned) in enumerate(groups):
                self._gather(src, pinned, dev[2 * i], cache, dev[2 * i + 1])
            upd = dev[2 * len(groups)]
            half = upd.shape[0] // 2
            cache.slot_map[upd[:half]] = upd[half:]
        if self.cuda:
            self._event = torch.cuda.Event()
            self._event.record()
            if self.host is not None:
                self.host.note_reader(id(self), self._event)

    def _gather(self, src: torch.Tensor, pinned: bool, rows: torch.Tensor, cache: LayerCache,
                dst: torch.Tensor) -> None:
        triton_ok = self.gather_mode == "triton" and pinned
        bb = self.layout.block_bytes
        try:
            gather_pages(src, rows, cache.k, cache.v, dst, block_bytes=bb, use_triton=triton_ok, config=self.gather)
        except ValueError as e:  # this GPU/driver cannot read the host buffer in place
            if not triton_ok or "cannot be accessed" not in str(e):
                raise
            self.gather_mode = "copy"
            gather_pages(src, rows, cache.k, cache.v, dst, block_bytes=bb, use_triton=False)
        self.stats.gather_launches += 1

    def _wait_own(self) -> None:
        if self._event is not None:
            self._event.synchronize()
