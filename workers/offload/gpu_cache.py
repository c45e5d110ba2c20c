"""The GPU page cache of one layer, and the view of it a fetch returns to attention.

Pools ``k``, ``v`` ``[n_slots * P + extra, D]`` hold pages in slots (slot ``s`` is rows
``[s * P, (s + 1) * P)``), shared by all KV heads of the layer; the attention kernel sees them as
``[Hkv, rows, D]`` with a zero head stride and indexes rows per head. A device map (head, page) ->
slot turns the selector's token ids into rows. Extra rows after the slots hold per-head entries
such as Double-P centroids (head ``h``'s entry ``m`` is row ``extra_base + h * n_extra + m``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.offload.lru import SlotLRU
from workers.pages import page_of


@dataclass(frozen=True)
class FetchResult:
    """The layer's page cache after a fetch; valid until the next fetch of the same layer."""

    k: torch.Tensor
    """``[Hkv, rows, D]`` K pool (zero head stride: every head indexes the same rows)."""
    v: torch.Tensor
    """``[Hkv, rows, D]`` V pool."""
    slot_map: torch.Tensor
    """``[Hkv, n_pages]`` int64 slot of each resident page, -1 elsewhere."""
    page_size: int
    n_tokens: int
    extra_base: int
    """First extra row (after the page slots)."""
    n_extra: int
    """Extra rows per head."""
    rows: torch.Tensor | None = None
    """From ``PageFetcher.fetch``: ``[Hkv, n]`` int64 first pool row of each requested page, aligned with
    its ``pages`` argument (-1 for padding); a token ``t`` of page ``pages[h, j]`` is row
    ``rows[h, j] + t % page_size``."""

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        sm = self.slot_map.expand(*pages.shape[:-2], -1, -1)
        return sm.gather(-1, pages.clamp(0, self.slot_map.shape[1] - 1).long())

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Page ids ``[..., Hkv, n]`` -> first pool row of each (int64); -1 for padding (< 0) or a page
        that is not resident."""
        s = self._slots(pages)
        return torch.where((pages >= 0) & (s >= 0), s * self.page_size, -1)

    def token_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[..., Hkv, n]`` -> pool rows (int64), for the kernel's ``idx``.

        -1 marks a token outside the prefix or whose page was not fetched: rows of the tokens a step
        fetched are always >= 0; never pass a -1 as a valid entry (padding past ``n_valid`` is never read).
        """
        p = self.page_size
        ok = (tokens >= 0) & (tokens < self.n_tokens)
        s = self._slots(page_of(tokens, p))
        return torch.where(ok & (s >= 0), s * p + tokens.remainder(p), -1)

    def extra_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Per-head extra entry ids ``[..., Hkv, m]`` -> pool rows (int64)."""
        heads = torch.arange(self.slot_map.shape[0], device=ids.device).unsqueeze(-1)
        return self.extra_base + heads * self.n_extra + ids.long()


class LayerCache:
    """K/V pools, exact LRU over slots and the device (head, page) -> slot map of one layer."""

    def __init__(self, *, n_slots: int, n_heads: int, n_pages: int, n_tokens: int, page_size: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.n_slots, self.n_heads, self.n_pages, self.n_tokens = n_slots, n_heads, n_pages, n_tokens
        self.page_size, self.head_dim = page_size, head_dim
        self.n_extra = 0
        self.k = torch.zeros(n_slots * page_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lru = SlotLRU(n_slots)
        self.lru.add_namespace(0, n_heads * n_pages)
        self.slot_map = torch.full((n_heads * n_pages,), -1, dtype=torch.int64, device=device)

    @property
    def gpu_bytes(self) -> int:
        """Bytes of the pools (page slots and extra rows)."""
        return 2 * self.k.numel() * self.k.element_size()

    def result(self, rows: torch.Tensor | None = None) -> FetchResult:
        """The view attention reads (``rows``: see ``FetchResult.rows``)."""
        n = self.k.shape[0]
        return FetchResult(k=self.k.unsqueeze(0).expand(self.n_heads, n, self.head_dim),
                           v=self.v.unsqueeze(0).expand(self.n_heads, n, self.head_dim),
                           slot_map=self.slot_map.view(self.n_heads, self.n_pages), page_size=self.page_size,
                           n_tokens=self.n_tokens, extra_base=self.n_slots * self.page_size,
                           n_extra=self.n_extra, rows=rows)

    def set_extra(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store per-head extra entries ``[Hkv, M, D]`` after the page slots (resizing the pools)."""
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != self.n_heads or k.shape[2] != self.head_dim:
            raise ValueError(f"extra K/V must be [{self.n_heads}, M, {self.head_dim}], got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        base = self.n_slots * self.page_size
        rows = base + k.shape[0] * k.shape[1]
        if rows != self.k.shape[0]:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.zeros(rows, self.head_dim, dtype=old.dtype, device=old.device)
                new[:base] = old[:base]
                setattr(self, name, new)
        self.k[base:] = k.reshape(-1, self.head_dim).to(self.k)
        self.v[base:] = v.reshape(-1, self.head_dim).to(self.v)
        self.n_extra = k.shape[1]

    def invalidate(self) -> None:
        """Forget every cached page (after a failed fill: nothing half-written is ever served)."""
        self.lru = SlotLRU(self.n_slots)
        self.lru.add_namespace(0, self.n_heads * self.n_pages)
        self.slot_map.fill_(-1)
