"""Chunked prefill: run the model over a document and collect every layer's post-RoPE K and V.

Each layer's K/V goes into a buffer of the document's length allocated at its first chunk, and each
chunk is written in place: transformers' dynamic cache concatenates per chunk, which copies every
earlier chunk again (quadratic in the document: at 128k tokens and 2k chunks, about 64 copies of half
the cache per layer, more time than the forward pass itself).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from workers.model import LoadedModel

DEFAULT_CHUNK = 2048


class FilledLayer(DynamicLayer):
    """A dynamic cache layer over a buffer of ``capacity`` tokens, filled chunk by chunk in place."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._k = self._v = torch.empty(0)
        self._end = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the buffers (shapes and dtype from the first chunk)."""
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty((b, h, self.capacity, d))
        self._v = value_states.new_empty((b, value_states.shape[1], self.capacity, value_states.shape[3]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a chunk after the tokens so far; returns every token's K, V through it (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._end + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"prefill cache full: {end} tokens > capacity {self.capacity}")
        self._k[..., self._end:end, :].copy_(key_states)
        self._v[..., self._end:end, :].copy_(value_states)
        self._end = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values


def filled_cache(lm: LoadedModel, n_tokens: int) -> DynamicCache:
    """A cache for one ``n_tokens`` forward in chunks: its plain dynamic layers fill preallocated buffers."""
    cache = DynamicCache(config=lm.model.config)
    cache.layers = [FilledLayer(n_tokens) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.inference_mode()
def prefill_kv(lm: LoadedModel, token_ids: list[int], *, chunk_size: int = DEFAULT_CHUNK,
               progress: bool = True, desc: str = "prefill") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(layer, K, V)`` with K, V ``[kv_heads, n_tokens, head_dim]`` as attention saw them (the forward
    pass's progress bar, when shown, is labelled ``desc``)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n = len(token_ids)
    cache = filled_cache(lm, n)
    ids = torch.tensor([token_ids], device=lm.device)
    base = lm.model.get_decoder()
    bar = tqdm(total=n, unit="tok", desc=desc, disable=not progress, leave=False)
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        pos = torch.arange(start, end, device=lm.device)[None]
        base(input_ids=ids[:, start:end], position_ids=pos, past_key_values=cache, use_cache=True)
        bar.update(end - start)
    bar.close()
    for layer, cached in enumerate(cache.layers):
        yield layer, cached.keys[0], cached.values[0]  # type: ignore[union-attr,index]
