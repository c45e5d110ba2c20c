"""Chunked prefill: run the model over a document and collect every layer's post-RoPE K and V.

Models with a plain decoder stack (``LAYER_MAJOR_MODELS``) are run layer by layer, every chunk through one layer
before the next layer starts: each layer's K/V is final as soon as its pass ends, so the caller stores it (its pages
hashed and written, its summaries computed) while the next layers run, instead of after the whole forward pass.
Other models are run chunk by chunk through all layers, and their layers are handed on at the end.

Each layer's K/V goes into a buffer of the document's length allocated at its first chunk, and each
chunk is written in place: transformers' dynamic cache concatenates per chunk, which copies every
earlier chunk again (quadratic in the document: at 128k tokens and 2k chunks, about 64 copies of half
the cache per layer, more time than the forward pass itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask

from workers.model import LoadedModel

DEFAULT_CHUNK = 2048
LAYER_MAJOR_MODELS = frozenset({"llama"})
"""``model_type``s whose decoder is embeddings, rotary embeddings and a list of full-attention layers called as
``LlamaModel.forward`` calls them: what ``_layer_major`` reproduces."""


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
    """Yield ``(layer, K, V)`` with K, V ``[kv_heads, n_tokens, head_dim]`` as attention saw them, in layer order,
    each as soon as it is final (the forward pass's progress bar, when shown, is labelled ``desc``)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n = len(token_ids)
    cache = filled_cache(lm, n)
    ids = torch.tensor([token_ids], device=lm.device)
    base = lm.model.get_decoder()
    bar = tqdm(total=n * lm.layout.n_layers, unit="tok", unit_scale=1 / lm.layout.n_layers, desc=desc,
               disable=not progress, leave=False)
    run = _layer_major if getattr(base.config, "model_type", None) in LAYER_MAJOR_MODELS else _chunk_major
    try:
        yield from run(base, ids, cache, chunk_size, bar)
    finally:
        bar.close()


def _chunk_major(base: torch.nn.Module, ids: torch.Tensor, cache: DynamicCache, chunk_size: int, bar: tqdm
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Every chunk through the whole model, then every layer's K/V."""
    n = ids.shape[1]
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        pos = torch.arange(start, end, device=ids.device)[None]
        base(input_ids=ids[:, start:end], position_ids=pos, past_key_values=cache, use_cache=True)
        bar.update((end - start) * len(cache.layers))
    for layer, cached in enumerate(cache.layers):
        yield layer, cached.keys[0], cached.values[0]  # type: ignore[union-attr,index]


def _layer_major(base: Any, ids: torch.Tensor, cache: DynamicCache, chunk_size: int, bar: tqdm
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Every chunk through one layer, that layer's K/V, then the next layer: the hidden states of the whole
    document are kept between layers (one ``[n, hidden]`` buffer, each chunk overwritten by its next layer's).
    ``base`` is a ``LlamaModel``-like decoder (typed loosely: its submodules are reached by name)."""
    n = ids.shape[1]
    hidden = base.embed_tokens(ids)
    spans = [(s, min(n, s + chunk_size)) for s in range(0, n, chunk_size)]
    positions = [torch.arange(s, e, device=ids.device)[None] for s, e in spans]
    rope = [base.rotary_emb(hidden[:, s:e], position_ids=pos) for (s, e), pos in zip(spans, positions, strict=True)]
    for layer, decoder_layer in enumerate(base.layers[: base.config.num_hidden_layers]):
        for (s, e), pos, emb in zip(spans, positions, rope, strict=True):
            x = hidden[:, s:e]
            mask = create_causal_mask(config=base.config, inputs_embeds=x, attention_mask=None,
                                      past_key_values=cache, position_ids=pos, layer_idx=layer)
            out = decoder_layer(x, attention_mask=mask, position_embeddings=emb, position_ids=pos,
                                past_key_values=cache, use_cache=True)
            hidden[:, s:e] = out[0] if isinstance(out, tuple) else out
            bar.update(e - s)
        cached = cache.layers[layer]
        yield layer, cached.keys[0], cached.values[0]  # type: ignore[union-attr,index]
        cache.layers[layer] = DynamicLayer()  # the caller holds this layer's K/V as long as it needs them
