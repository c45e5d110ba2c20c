"""The model's own K/V of one generation (its query and generated tokens), in one growing buffer.

The stored prefix is attended through the decode method; only the tokens a generation adds live
here. The buffer starts with room for the query and a few steps and doubles when a step needs
more, up to the generation's whole length (query + ``max_new_tokens``): a long ``max_new_tokens``
costs memory only as tokens are generated, and growing is rare (log steps). A step writes its
tokens at the current length and the length moves only when the step completes (``commit``), so
a step that fails leaves no trace.
"""

from __future__ import annotations

import torch

from store.layout import KVLayout

FIRST_STEPS = 64
"""Generated tokens the buffer has room for from the start (beyond the query)."""


class OwnKV:
    """Per-layer K and V ``[kv_heads, tokens, head_dim]`` of one generation's own tokens."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device, dtype: torch.dtype,
                 initial: int | None = None):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        """The most tokens it will ever hold."""
        self.length = 0
        """Tokens committed by completed steps."""
        size = min(capacity, max(1, initial if initial is not None else capacity))
        self._buf = torch.empty((layout.n_layers, 2, layout.n_kv_heads, size, layout.head_dim), device=device,
                                dtype=dtype)
        self.seed: torch.Tensor | None = None
        """``[layers, 2, kv_heads, head_dim]``: the prefix's last stored K, V, which a model with a decaying
        memory continues from before its first own token (None: zeros)."""

    @property
    def n_layers(self) -> int:
        """Layers it holds K/V of."""
        return self._buf.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now."""
        return self._buf.numel() * self._buf.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Place a step's K, V ``[kv_heads, n, head_dim]`` after the committed tokens; returns every
        own token's K, V through them (views ``[kv_heads, length + n, head_dim]``)."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"own KV full: {end} tokens > capacity {self.capacity}")
        if end > self._buf.shape[3]:
            self._grow(end)
        buf = self._buf[layer]
        buf[0, :, self.length:end].copy_(k)
        buf[1, :, self.length:end].copy_(v)
        return buf[0, :, :end], buf[1, :, :end]

    def reserve(self, n: int) -> None:
        """Room for ``n`` tokens in the buffer now (a captured step cannot grow it)."""
        if n > self.capacity:
            raise ValueError(f"own KV full: {n} tokens > capacity {self.capacity}")
        if n > self._buf.shape[3]:
            self._grow(n)

    @property
    def buffer_key(self) -> tuple[int, int]:
        """Address and size of the buffer (a captured step is valid while they hold)."""
        return self._buf.data_ptr(), self._buf.shape[3]

    def buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffer's K, V of one layer (views ``[kv_heads, size, head_dim]``, rows past the written
        tokens undefined)."""
        buf = self._buf[layer]
        return buf[0], buf[1]

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the committed tokens of one layer (views ``[kv_heads, length, head_dim]``)."""
        buf = self._buf[layer]
        return buf[0, :, : self.length], buf[1, :, : self.length]

    def _grow(self, need: int) -> None:
        """Room for ``need`` tokens at least: double, within the capacity, keeping what is written."""
        size = min(self.capacity, max(need, 2 * self._buf.shape[3]))
        new = self._buf.new_empty((*self._buf.shape[:3], size, self._buf.shape[4]))
        # Every layer's committed tokens (and anything a step wrote before growing) move over.
        new[:, :, :, : self._buf.shape[3]].copy_(self._buf)
        self._buf = new

    def last(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[kv_heads, head_dim]`` of the last committed own token, else ``seed``'s (zeros without one)."""
        if self.length > 0:
            kv = self._buf[layer, :, :, self.length - 1]
        elif self.seed is not None:
            kv = self.seed[layer]
        else:
            kv = self._buf.new_zeros(self._buf.shape[1:3] + self._buf.shape[4:])
        return kv[0], kv[1]

    def commit(self, n: int) -> None:
        """A step that wrote ``n`` tokens in every layer completed."""
        if self.length + n > self.capacity:
            raise ValueError("commit beyond capacity")
        self.length += n
