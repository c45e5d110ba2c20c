"""A warm prefix's pages attended where they lie in the host tier: the CPU's fetch, with no copy into a pool.

On a CPU device the host tier and a page pool are both main memory, so copying the pages a step picks
into a pool only costs time. For a generation whose prefix lies whole in the host tier,
``HostPageView`` holds the prefix's host-tier slots (they cannot be evicted while it is open) and
serves the host tier itself as the K/V pool attention indexes: each page's K block is ``P`` rows of
``D`` values, its V block the next ``P`` rows, so the slot buffer viewed as ``[rows, D]`` gives K rows
and the same buffer shifted by one block gives V rows under one row index (``slot * rows_per_slot +
offset``). A step only turns token or page ids into those rows (numpy, no per-page Python). A layer's
extra entries (Double-P's centroids) go into host-tier slots of their own, packed as pages and held
until the view closes, so that attention reads them from the same pools (``set_extra``).

Reads are counted as fetches from the host tier (``OffloadStats``: every distinct page a step attends is
a host-tier page, never a cache hit), so a method's read report stays what it read.
"""

from __future__ import annotations

import numpy as np
import torch

from store.errors import InvalidInput
from workers.kernels import token_rows as token_rows_kernel
from workers.offload.fetcher import PageFetcher
from workers.offload.stats import StepCounts

CPU_KERNEL = True
"""``token_rows`` and ``page_rows`` through the C++ token-rows kernel (``workers/kernels/token_rows``: the same rows and
page count, one pass instead of some ten numpy ops and a sort), where it builds; False: numpy."""


class HostPageView:
    """The host-tier pages of one generation's warm prefix, attended in place (see the module docstring)."""

    def __init__(self, fetcher: PageFetcher, slots: np.ndarray):
        lay = fetcher.layout
        assert fetcher.host is not None
        self.fetcher, self.host = fetcher, fetcher.host
        self.page_size, self.n_pages, self.n_tokens = lay.page_size, fetcher.n_pages, fetcher.n_tokens
        self.rows_per_slot = lay.page_bytes // (lay.head_dim * lay.elem_bytes)
        """Pool rows one host slot spans: its K block, its V block, padding."""
        self._held: np.ndarray | None = slots
        self.first_rows = slots.reshape(lay.n_layers, lay.n_kv_heads, self.n_pages) * self.rows_per_slot
        """``[layers, Hkv, n_pages]`` the pool row of each page's first token."""
        self._first_rows_t = torch.from_numpy(np.ascontiguousarray(self.first_rows, dtype=np.int64))
        """``first_rows`` as a torch tensor (the token-rows kernel's input)."""
        flat = self.host.pages.view(-1).view(lay.torch_dtype)
        block = lay.page_size * lay.head_dim  # V rows are K rows one block later: one row index serves both
        n = flat.numel() - block
        h, d = lay.n_kv_heads, lay.head_dim
        self.k = flat[:n].view(-1, d).unsqueeze(0).expand(h, -1, -1)
        """``[Hkv, rows, D]`` K pool over the host tier's slots (zero head stride)."""
        self.v = flat[block:].view(-1, d).unsqueeze(0).expand(h, -1, -1)
        """``[Hkv, rows, D]`` V pool."""
        self._extra: dict[int, tuple[str, np.ndarray, torch.Tensor]] = {}
        """Layer -> its extra entries' host-tier namespace, held slots and pool rows ``[Hkv, M]``."""
        self._no_room: set[int] = set()
        """Layers whose extra entries did not fit in the host tier (their steps stay with the fetcher)."""

    @classmethod
    def from_fetcher(cls, fetcher: PageFetcher) -> HostPageView | None:
        """A view of ``fetcher``'s prefix, or None when it cannot serve: not a CPU device, no host tier, a page of
        the prefix not in the tier, or pages whose byte stride is not a whole number of K rows."""
        host, lay = fetcher.host, fetcher.layout
        if fetcher.device.type != "cpu" or host is None or lay.page_bytes % (lay.head_dim * lay.elem_bytes):
            return None
        slots = host.hold(fetcher.prefix_id, np.arange(lay.n_layers * fetcher.n_keys, dtype=np.int64))
        return None if slots is None else cls(fetcher, slots)

    def page_rows(self, layer: int, pages: torch.Tensor, step: int) -> torch.Tensor:
        """First pool rows ``[Hkv, n]`` of pages ``[Hkv, n]`` (ids per KV head, -1 padding: row -1), counted as
        read from the host tier under ``step``."""
        if CPU_KERNEL and pages.dtype == torch.int64 and pages.dim() == 2 and token_rows_kernel.cpu_kernel_available():
            try:
                rows_t, n = token_rows_kernel.page_rows(pages, self._first_rows_t[layer])
            except ValueError:
                raise InvalidInput(f"page ids must be < {self.n_pages} (the prefix has {self.n_tokens} tokens)"
                                   ) from None
            self.fetcher.stats.record(step, StepCounts(pages=n, host_pages=n))
            return rows_t
        p = pages.numpy()
        if p.size and p.max() >= self.n_pages:
            raise InvalidInput(f"page ids must be < {self.n_pages} (the prefix has {self.n_tokens} tokens)")
        heads = np.arange(p.shape[0])[:, None]
        rows = np.where(p >= 0, self.first_rows[layer][heads, np.maximum(p, 0)], -1)
        self._count(step, (heads * self.n_pages + p)[p >= 0])
        return torch.from_numpy(rows)

    def token_rows(self, layer: int, tokens: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Pool rows ``[..., Hkv, n]`` of the token ids ``[..., Hkv, n]``, whose first ``counts [..., Hkv]`` per row
        are counted as read from the host tier under ``step`` (ids outside the prefix raise; padding past a row's
        count gets row -1)."""
        if CPU_KERNEL and tokens.dtype == counts.dtype == torch.int64 and token_rows_kernel.cpu_kernel_available():
            try:
                rows_t, n = token_rows_kernel.token_rows(tokens, counts, self._first_rows_t[layer], self.page_size,
                                                         self.n_tokens)
            except ValueError as e:
                raise InvalidInput(str(e)) from None
            self.fetcher.stats.record(step, StepCounts(pages=n, host_pages=n))
            return rows_t
        t = tokens.numpy()
        valid = np.arange(t.shape[-1]) < counts.numpy()[..., None]
        ok = (t >= 0) & (t < self.n_tokens)
        if (valid & ~ok).any():
            raise InvalidInput(f"token ids must lie in [0, {self.n_tokens})")
        page = np.where(ok, t, 0) // self.page_size
        heads = np.arange(t.shape[-2])[:, None]
        rows = np.where(ok, self.first_rows[layer][heads, page] + np.where(ok, t, 0) % self.page_size, -1)
        self._count(step, (heads * self.n_pages + page)[valid])
        return torch.from_numpy(rows)

    def extra_rows(self, layer: int) -> torch.Tensor | None:
        """Pool rows ``[Hkv, M]`` of ``layer``'s extra entries (``set_extra``), or None."""
        got = self._extra.get(layer)
        return None if got is None else got[2]

    def set_extra(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Put ``layer``'s per-head extra entries ``[Hkv, M, D]`` (model dtype) in host-tier slots held until
        ``close``; whether they are there (False: the tier has no room beside its held pages, and will not be
        asked again)."""
        if layer in self._extra or layer in self._no_room:
            return layer in self._extra
        h, m, d = k.shape
        p, n = self.page_size, -(-m // self.page_size)  # pages per head
        kv = k.new_zeros(h, n * p, 2, d)
        kv[:, :m, 0], kv[:, :m, 1] = k, v
        payload = kv.view(h, n, p, 2, d).transpose(2, 3).reshape(h * n, -1).view(torch.uint8)  # K block, V block
        raw = torch.zeros(h * n, self.host.page_bytes, dtype=torch.uint8)
        raw[:, : payload.shape[1]] = payload
        name = f"{self.fetcher.prefix_id}/extra/{id(self)}/{layer}"  # this view's own: no other reader finds it
        keys = np.arange(h * n, dtype=np.int64)
        with self.host.lock:
            self.host.open_prefix(name, h * n)
            self.host.begin_batch()
            slots = self.host.insert(name, keys, raw.numpy())
            if slots is None:
                self.host.drop_prefix(name)
                self._no_room.add(layer)
                return False
            self.host.hold(name, keys)
        ids = np.arange(m)
        rows = slots.reshape(h, n)[:, ids // p] * self.rows_per_slot + ids % p
        self._extra[layer] = (name, slots, torch.from_numpy(rows))
        return True

    def _count(self, step: int, keys: np.ndarray) -> None:
        """File the distinct pages ``keys`` (head * n_pages + page) as one host-tier fetch of ``step``."""
        n = int(np.unique(keys).size)
        self.fetcher.stats.record(step, StepCounts(pages=n, host_pages=n))

    def close(self) -> None:
        """Release the held slots and drop the extra entries (nothing reads them after this)."""
        for name, slots, _ in self._extra.values():
            with self.host.lock:
                self.host.release(slots)
                self.host.drop_prefix(name)
        self._extra.clear()
        if self._held is not None:
            self.host.release(self._held)
            self._held = None
