"""A warm prefix's pages attended where they lie in the host tier: the CPU's fetch, with no copy into a pool.

On a CPU device the host tier and a page pool are both main memory, so copying the pages a step picks
into a pool only costs time. For a generation whose prefix lies whole in the host tier,
``HostPageView`` holds the prefix's host-tier slots (they cannot be evicted while it is open) and
serves the host tier itself as the K/V pool attention indexes: each page's K block is ``P`` rows of
``D`` values, its V block the next ``P`` rows, so the slot buffer viewed as ``[rows, D]`` gives K rows
and the same buffer shifted by one block gives V rows under one row index (``slot * rows_per_slot +
offset``). A step only turns token or page ids into those rows (numpy, no per-page Python).

Reads are counted as fetches from the host tier (``OffloadStats``: every distinct page a step attends is
a host-tier page, never a cache hit), so a method's read report stays what it read.
"""

from __future__ import annotations

import numpy as np
import torch

from store.errors import InvalidInput
from workers.offload.fetcher import PageFetcher
from workers.offload.stats import StepCounts


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
        flat = self.host.pages.view(-1).view(lay.torch_dtype)
        block = lay.page_size * lay.head_dim  # V rows are K rows one block later: one row index serves both
        n = flat.numel() - block
        h, d = lay.n_kv_heads, lay.head_dim
        self.k = flat[:n].view(-1, d).unsqueeze(0).expand(h, -1, -1)
        """``[Hkv, rows, D]`` K pool over the host tier's slots (zero head stride)."""
        self.v = flat[block:].view(-1, d).unsqueeze(0).expand(h, -1, -1)
        """``[Hkv, rows, D]`` V pool."""

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

    def _count(self, step: int, keys: np.ndarray) -> None:
        """File the distinct pages ``keys`` (head * n_pages + page) as one host-tier fetch of ``step``."""
        n = int(np.unique(keys).size)
        self.fetcher.stats.record(step, StepCounts(pages=n, host_pages=n))

    def close(self) -> None:
        """Release the held slots (nothing reads them after this)."""
        if self._held is not None:
            self.host.release(self._held)
            self._held = None
