"""Chunked prefill: run the model over a document and collect every layer's post-RoPE K and V."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from workers.model import LoadedModel

DEFAULT_CHUNK = 2048


@torch.inference_mode()
def prefill_kv(lm: LoadedModel, token_ids: list[int], *, chunk_size: int = DEFAULT_CHUNK,
               progress: bool = True, desc: str = "prefill") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(layer, K, V)`` with K, V ``[kv_heads, n_tokens, head_dim]`` as attention saw them (the forward
    pass's progress bar, when shown, is labelled ``desc``)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    cache = DynamicCache(config=lm.model.config)
    n = len(token_ids)
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
