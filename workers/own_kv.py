"""The model's own K/V of one generation (its query and generated tokens), in preallocated buffers.

The stored prefix is attended through the decode method; only the tokens a generation adds live
here. Buffers are allocated for the generation's whole length (query + ``max_new_tokens``) when it
starts, so a decode step never allocates; a step writes its tokens at the current length and the
length moves only when the step completes (``commit``), so a step that fails leaves no trace.
"""

from __future__ import annotations

import torch

from store.layout import KVLayout


class OwnKV:
    """Per-layer K and V ``[kv_heads, capacity, head_dim]`` of one generation's own tokens."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device, dtype: torch.dtype):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        shape = (layout.n_layers, 2, layout.n_kv_heads, capacity, layout.head_dim)
        self._buf = torch.empty(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0
        """Tokens committed by completed steps."""

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (allocated once)."""
        return self._buf.numel() * self._buf.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Place a step's K, V ``[kv_heads, n, head_dim]`` after the committed tokens; returns every
        own token's K, V through them (views ``[kv_heads, length + n, head_dim]``)."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"own KV full: {end} tokens > capacity {self.capacity}")
        buf = self._buf[layer]
        buf[0, :, self.length:end].copy_(k)
        buf[1, :, self.length:end].copy_(v)
        return buf[0, :, :end], buf[1, :, :end]

    def commit(self, n: int) -> None:
        """A step that wrote ``n`` tokens in every layer completed."""
        if self.length + n > self.capacity:
            raise ValueError("commit beyond capacity")
        self.length += n
