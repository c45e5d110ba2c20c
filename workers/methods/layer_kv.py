"""Where one layer's prefix K/V comes from at decode time: resident on the device, or fetched per step.

Sparse methods see a layer through ``LayerKV``. Per step they ask for the tokens they attend
(``step``) and get back pools plus the kernel's ``idx`` rows of those tokens (``StepKV``):

- ``ResidentKV``: the layer's K/V read once and held (the reference path; rows = token ids);
- ``FetchedKV``: only the pages holding the step's tokens are made resident, through the worker's
  tiered ``PageFetcher`` (GPU page cache -> pinned host tier -> SSD page files); rows point into
  the layer's GPU page cache. On a CPU device with the prefix whole in the host tier, rows point
  into the host tier itself (``HostPageView``: nothing is copied).

Both give the same attention inputs for the same tokens, so greedy output does not depend on
the path; the fetched path only moves less.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from store.errors import InvalidInput
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher
from workers.offload.host_view import HostPageView
from workers.pages import page_mask


@dataclass(frozen=True)
class StepKV:
    """One step's view of a layer: pools the kernel reads and the rows of the step's tokens in them."""

    k: torch.Tensor
    """``[Hkv, R, D]`` K pool (model dtype)."""
    v: torch.Tensor
    """``[Hkv, R, D]`` V pool."""
    rows: torch.Tensor
    """``[T, Hkv, n]`` int64 pool row of each requested token (entries past a row's count: unspecified)."""
    extra_base: int
    """Pool row of head ``h``'s extra entry ``m`` is ``extra_base + h * extra_stride + m``."""
    extra_stride: int
    """0 where each head has its own pool rows; the per-head entry count where heads share rows."""
    extra_table: torch.Tensor | None = None
    """``[Hkv, M]`` int64 pool row of each extra entry, where they do not follow that rule (a host view's)."""

    def extra_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Per-head extra entry ids ``[T, Hkv, m]`` -> pool rows (int64)."""
        if self.extra_table is not None:
            return self.extra_table.unsqueeze(0).expand(ids.shape[0], -1, -1).gather(2, ids.long())
        heads = torch.arange(ids.shape[-2], device=ids.device).unsqueeze(-1)
        return self.extra_base + heads * self.extra_stride + ids.long()

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[T, Hkv, n, D]`` at pool rows ``[T, Hkv, n]`` (rows must be valid)."""
        t = rows.shape[0]
        if self.k.device.type == "cpu":  # the same copy; indexing is about 2x faster than expand + gather there
            heads = torch.arange(rows.shape[1], device=rows.device).unsqueeze(-1)
            at_rows = rows.clamp_min(0)
            return self.k[heads, at_rows], self.v[heads, at_rows]
        at = rows.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, self.k.shape[-1])
        return (self.k.unsqueeze(0).expand(t, -1, -1, -1).gather(2, at),
                self.v.unsqueeze(0).expand(t, -1, -1, -1).gather(2, at))


def page_tokens(first: torch.Tensor, page_size: int) -> torch.Tensor:
    """First rows (or token ids) of pages ``[..., n]`` -> every row of those pages ``[..., n * page_size]``."""
    return (first.unsqueeze(-1) + torch.arange(page_size, device=first.device)).flatten(-2)


def pages_of_tokens(tokens: torch.Tensor, counts: torch.Tensor, n_tokens: int,
                    page_size: int) -> tuple[torch.Tensor, int]:
    """The distinct pages per KV head of the first ``counts [T, Hkv]`` ids of ``tokens [T, Hkv, n]``.

    Returns ``[Hkv, n_pages]`` page ids, each head's distinct pages first (ascending) then -1, and the
    largest per-head count (one device -> host sync). Ids outside ``[0, n_tokens)`` raise.
    """
    mask, outside = page_mask(tokens, counts, n_tokens, page_size)
    h, n_pages = mask.shape
    order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
    per_head = mask.sum(1)
    pages = torch.where(torch.arange(n_pages, device=tokens.device) < per_head.unsqueeze(1), order, -1)
    bad, widest = torch.stack([outside, per_head.max() if h else outside.new_zeros(())]).tolist()  # one sync
    if bad:
        raise InvalidInput(f"token ids must lie in [0, {n_tokens})")
    return pages, int(widest)


class LayerKV(abc.ABC):
    """Decode-time access to one layer's stored K/V ``[Hkv, N, D]``."""

    def __init__(self, *, n_heads: int, n_tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int):
        self.n_heads, self.n_tokens, self.head_dim = n_heads, n_tokens, head_dim
        self.dtype, self.device, self.page_size = dtype, device, page_size
        self.at_step = 0
        """The decode step being served (set by the method before selection; files fetches under it)."""

    @abc.abstractmethod
    def tokens(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[Hkv, n, D]`` of token ids ``[n]`` (the same ids for every head; a one-time read made
        while preparing the first step)."""

    @abc.abstractmethod
    def mid_keys(self, lo: int, hi: int) -> torch.Tensor:
        """Keys ``[Hkv, hi - lo, D]`` held resident for exhaustive scoring (read once)."""

    @abc.abstractmethod
    def mid_keys_bytes(self, lo: int, hi: int) -> int:
        """Prefix bytes ``mid_keys(lo, hi)`` reads."""

    @abc.abstractmethod
    def keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """Exact keys ``[T, Hkv, n, D]`` of token ids ``[T, Hkv, n]`` (all valid), read for this step."""

    @abc.abstractmethod
    def set_extra(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Per-head extra entries ``[Hkv, M, D]`` (Double-P centroids) every later step can attend."""

    def graph_key(self, n_pages: int) -> object | None:
        """What a CUDA graph of a single-row ``step_pages`` of ``n_pages`` pages depends on, or None when such a
        step cannot be captured now (it would do host work: a fetch from the host tier's reader or SSD)."""
        return None

    @abc.abstractmethod
    def step_pages(self, pages: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make whole pages ``[Hkv, n]`` (ids per head, unique per head) attendable for a single-row step:
        (K pool, V pool ``[Hkv, R, D]``, first pool row of each page ``[Hkv, n]``)."""

    @abc.abstractmethod
    def step(self, tokens: torch.Tensor, counts: torch.Tensor, step: int, *, overflow: bool = False) -> StepKV:
        """Make the first ``counts [T, Hkv]`` ids of ``tokens [T, Hkv, n]`` attendable for one step.

        A fetched layer raises ``CacheTooSmall`` when the tokens' pages exceed its GPU page cache,
        unless ``overflow`` (then they are served from a one-off pool)."""


class ResidentKV(LayerKV):
    """The whole layer on the device (read once)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, page_size: int):
        super().__init__(n_heads=k.shape[0], n_tokens=k.shape[1], head_dim=k.shape[2], dtype=k.dtype,
                         device=k.device, page_size=page_size)
        self.k, self.v = k, v
        self._pools = (k, v)
        self._n_extra = 0

    def tokens(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``ids`` (indexing the resident layer)."""
        return self.k[:, ids], self.v[:, ids]

    def mid_keys(self, lo: int, hi: int) -> torch.Tensor:
        """A view of the resident keys."""
        return self.k[:, lo:hi]

    def mid_keys_bytes(self, lo: int, hi: int) -> int:
        """The mid keys (what a decoder holding only them would read)."""
        return self.n_heads * (hi - lo) * self.head_dim * self.dtype.itemsize

    def keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """Indexing the resident keys."""
        heads = torch.arange(self.n_heads, device=tokens.device).view(1, -1, 1)
        return self.k[heads, tokens.long()]

    def set_extra(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the extra entries after each head's tokens."""
        self._pools = (torch.cat([self.k, k.to(self.dtype)], 1), torch.cat([self.v, v.to(self.dtype)], 1))
        self._n_extra = k.shape[1]

    def graph_key(self, n_pages: int) -> object | None:
        """Always capturable: the pools are the resident layer (a CPU step runs the same static path uncaptured)."""
        return ("resident", id(self))

    def step_pages(self, pages: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages are rows of the resident layer already."""
        k, v = self._pools
        return k, v, pages * self.page_size

    def step(self, tokens: torch.Tensor, counts: torch.Tensor, step: int, *, overflow: bool = False) -> StepKV:
        """Rows are the token ids themselves."""
        k, v = self._pools
        return StepKV(k=k, v=v, rows=tokens.long(), extra_base=self.n_tokens, extra_stride=0)


class FetchedKV(LayerKV):
    """Pages fetched on demand through the generation's ``PageFetcher`` (and its device-planned cache).

    ``read_layer(layer)`` reads a whole layer (K, V ``[Hkv, N, D]`` on the device, counted by its owner):
    the one-time read of the keys a selector holds resident. ``device_cache`` may be a callable asked at
    each step (None until the prefix is warm); so is ``host_view`` (a CPU device's warm prefix, attended in the
    host tier: it serves the steps the device cache does not, of a layer without extra entries).
    """

    def __init__(self, fetcher: PageFetcher, layer: int, *,
                 read_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 device_cache: DevicePageCache | Callable[[], DevicePageCache | None] | None = None,
                 host_view: Callable[[], HostPageView | None] | None = None):
        lay = fetcher.layout
        super().__init__(n_heads=lay.n_kv_heads, n_tokens=fetcher.n_tokens, head_dim=lay.head_dim,
                         dtype=lay.torch_dtype, device=fetcher.device, page_size=lay.page_size)
        self.fetcher, self.layer = fetcher, layer
        # A callable is asked at each step: the generation switches to the device-planned cache once warm.
        self._device_cache = device_cache if callable(device_cache) else lambda: device_cache
        self._read_layer = read_layer
        self._host_view = host_view or (lambda: None)
        self._extra = False
        self._extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        """The extra entries (model dtype), for the host view to take when it serves this layer."""
        self._fetcher_has_extra = False

    def tokens(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch the pages of ``ids`` (counted under step 0) and copy their K/V out of the page cache."""
        h, n = self.n_heads, ids.numel()
        tok = ids.to(self.device).long().view(1, 1, n).expand(1, h, n)
        sk = self.step(tok, torch.full((1, h), n, device=self.device), 0, overflow=True)
        k, v = sk.gather(sk.rows)
        return k[0].clone(), v[0].clone()

    def mid_keys(self, lo: int, hi: int) -> torch.Tensor:
        """Read the layer once from the store and keep only its mid keys."""
        k, _ = self._read_layer(self.layer)
        return k[:, lo:hi].contiguous()

    def mid_keys_bytes(self, lo: int, hi: int) -> int:
        """The whole layer's K and V (the store reads a layer whole)."""
        return 2 * self.n_heads * self.n_tokens * self.head_dim * self.dtype.itemsize

    def keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """Fetch the pages of ``tokens`` (counted as this step's pages) and copy their keys out."""
        t, h, n = tokens.shape
        sk = self.step(tokens, torch.full((t, h), n, device=tokens.device), self.at_step, overflow=True)
        return sk.gather(sk.rows)[0]

    def set_extra(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the entries in the layer's GPU page cache, after its page slots (on a CPU device, where a host
        view may serve every step, when the fetcher first serves one)."""
        self._extra_kv = (k.to(self.dtype), v.to(self.dtype))
        self._extra = True
        if self.device.type != "cpu":
            self._fetcher_extra()

    def _fetcher_extra(self) -> None:
        """Give the fetcher's pools the extra entries, once, before it serves a step of this layer."""
        if self._extra_kv is not None and not self._fetcher_has_extra:
            self.fetcher.set_extra_rows(self.layer, *self._extra_kv)
            self._fetcher_has_extra = True

    def graph_key(self, n_pages: int) -> object | None:
        """Capturable once the device-planned cache serves this layer's steps (the prefix is warm)."""
        dc = self._device_cache()
        if dc is None or self._extra or n_pages > dc.pages_per_call or self.device.type != "cuda":
            return None
        return ("device_plan", id(dc))

    def step_pages(self, pages: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Through the device-planned cache when it can take them (no host work, no sync), else the host view,
        else the fetcher."""
        dc = self._device_cache()
        if dc is not None and not self._extra and pages.shape[1] <= dc.pages_per_call:
            with self.fetcher.stats.timed("fetch", self.device):
                res = dc.fetch(self.layer, pages)
            assert res.rows is not None
            return res.k, res.v, res.rows
        if (view := self._view(dc)) is not None:
            with self.fetcher.stats.timed("fetch", self.device):
                return view.k, view.v, view.page_rows(self.layer, pages, step)
        self._fetcher_extra()
        first = pages * self.page_size  # each page's first token; a fetch of them fetches exactly these pages
        counts = torch.full((1, self.n_heads), first.shape[1], device=first.device)
        res = self.fetcher.fetch_tokens(self.layer, first[None], counts, step=step, overflow=True,
                                        one_off=self._served_by(dc))
        return res.k, res.v, res.token_rows(first)

    def _view(self, dc: DevicePageCache | None) -> HostPageView | None:
        """The host view when it serves this layer's steps: no device cache, and the layer's extra entries (if
        any) in its pools, put there on first use."""
        view = None if dc is not None else self._host_view()
        if view is None or self._extra_kv is None:
            return view
        return view if view.set_extra(self.layer, *self._extra_kv) else None

    def _served_by(self, dc: DevicePageCache | None) -> bool:
        """Whether the device-planned cache serves this layer's steps (then a larger fetch goes to a one-off pool:
        the fetcher keeps no GPU page cache of the layer beside it)."""
        return dc is not None and not self._extra

    def step(self, tokens: torch.Tensor, counts: torch.Tensor, step: int, *, overflow: bool = False) -> StepKV:
        """One tiered fetch of every page the rows touch; rows index the page cache.

        With the device-planned cache (a warm prefix, no extra entries) the fetch is planned
        on the device when the step's pages fit one call of it; otherwise the ``PageFetcher`` serves.
        """
        dc = self._device_cache()
        if dc is not None and not self._extra:
            pages, n = pages_of_tokens(tokens, counts, self.n_tokens, self.fetcher.layout.page_size)
            if 0 < n <= dc.pages_per_call:
                with self.fetcher.stats.timed("fetch", self.device):
                    res = dc.fetch(self.layer, pages[:, :n])
                return StepKV(k=res.k, v=res.v, rows=res.token_rows(tokens), extra_base=res.extra_base,
                              extra_stride=0)
        if (view := self._view(dc)) is not None:
            with self.fetcher.stats.timed("fetch", self.device):
                rows = view.token_rows(self.layer, tokens, counts, step)
            return StepKV(k=view.k, v=view.v, rows=rows, extra_base=0, extra_stride=0,
                          extra_table=view.extra_rows(self.layer))
        self._fetcher_extra()
        res = self.fetcher.fetch_tokens(self.layer, tokens, counts, step=step, overflow=overflow,
                                        one_off=self._served_by(dc))
        return StepKV(k=res.k, v=res.v, rows=res.token_rows(tokens), extra_base=res.extra_base,
                      extra_stride=res.n_extra)
