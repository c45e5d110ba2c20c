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


@pytest.mark.parametrize("chunk", [64, 1000])
def test_layer_major_prefill_equals_chunk_major(lm: LoadedModel, chunk: int, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """The layer-by-layer pass gives bit for bit the K/V of the chunk-by-chunk pass through the whole model."""
    assert lm.model.config.model_type in prefill.LAYER_MAJOR_MODELS
    ids = [(11 * i) % 200 + 3 for i in range(300)]
    got = [(layer, k.clone(), v.clone()) for layer, k, v in prefill_kv(lm, ids, chunk_size=chunk, progress=False)]
    monkeypatch.setattr(prefill, "LAYER_MAJOR_MODELS", frozenset())
    want = list(prefill_kv(lm, ids, chunk_size=chunk, progress=False))
    assert [g[0] for g in got] == [w[0] for w in want] == list(range(lm.layout.n_layers))
    for (_, kg, vg), (_, kw, vw) in zip(got, want, strict=True):
        assert torch.equal(kg, kw) and torch.equal(vg, vw)


def test_layer_major_prefill_hands_on_each_layer_before_the_next_runs(lm: LoadedModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's K/V reaches the caller before any chunk of a later layer runs (so it is stored meanwhile)."""
    calls: list[int] = []
    layers = lm.model.get_decoder().layers
    for i, layer in enumerate(layers):
        real = layer.forward

        def traced(*a: object, _i: int = i, _real: object = real, **k: object) -> object:
            calls.append(_i)
            return _real(*a, **k)  # type: ignore[operator]

        monkeypatch.setattr(layer, "forward", traced)
    seen = []
    gen = prefill_kv(lm, list(range(3, 203)), chunk_size=64, progress=False)
    for layer, _, _ in gen:
        assert calls and max(calls) == layer, (layer, calls)  # no later layer has run yet
        seen.append(layer)
    assert seen == list(range(len(layers))) and calls.count(0) == 4  # 200 tokens in chunks of 64
