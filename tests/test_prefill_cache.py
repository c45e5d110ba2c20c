"""Chunked prefill fills each layer's K/V in place (``workers.prefill``): same K/V as transformers' cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from workers import prefill
from workers.model import LoadedModel
from workers.prefill import FilledLayer, filled_cache, prefill_kv


@pytest.mark.parametrize("chunk", [64, 100, 1000])
def test_chunked_prefill_gives_the_dynamic_caches_kv(lm: LoadedModel, chunk: int, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    ids = [(7 * i) % 200 + 3 for i in range(300)]
    got = list(prefill_kv(lm, ids, chunk_size=chunk, progress=False))
    monkeypatch.setattr(prefill, "filled_cache", lambda lm, n: DynamicCache(config=lm.model.config))
    want = list(prefill_kv(lm, ids, chunk_size=chunk, progress=False))
    assert len(got) == len(want) == lm.layout.n_layers
    for (lg, kg, vg), (lw, kw, vw) in zip(got, want, strict=True):
        assert lg == lw and kg.shape == kw.shape == (lm.layout.n_kv_heads, len(ids), lm.layout.head_dim)
        assert torch.equal(kg, kw) and torch.equal(vg, vw)


def test_each_chunk_is_written_into_one_buffer(lm: LoadedModel) -> None:
    cache = filled_cache(lm, 10)
    layer = cache.layers[0]
    assert isinstance(layer, FilledLayer)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    k1, _ = layer.update(k, v)
    k2, v2 = layer.update(k[:, :, :3], v[:, :, :3])
    assert k2.data_ptr() == k1.data_ptr()  # the first chunk is not copied again
    assert torch.equal(k2, torch.cat([k, k[:, :, :3]], 2)) and torch.equal(v2, torch.cat([v, v[:, :, :3]], 2))
    assert layer.get_seq_length() == 7
    with pytest.raises(ValueError, match="capacity"):
        layer.update(k, v)
