"""Generations over one stored prefix share Top-K's key index (read once) and, on the CPU, its decoded keys."""

from __future__ import annotations

import gc

import pytest
import torch

from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods import shared_state
from workers.methods.key_index import KeyIndexSummarizer
from workers.methods.source import PrefixSource
from workers.methods.topk import TopK, TopKToken
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOC = "The lighthouse keeper counted ships until dawn, then wrote their names in a ledger. " * 12


def _source(store: KVStore, pid: str) -> PrefixSource:
    return PrefixSource(store, store.manifest(pid), torch.device("cpu"))


def test_generations_over_one_prefix_share_the_index_and_its_decoded_keys(worker: Worker, store: KVStore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second selector reads no index and scores on the first one's decoded keys (decoded once); another
    prefix gets its own; once no generation holds it, it is freed."""
    pid = worker.prefill(DOC).prefix_id
    other = worker.prefill(DOC + " And the sea was calm.").prefix_id
    cfg = DecodeConfig(budget=0.2)
    reads: list[str] = []
    start = KVStore.artifact_read
    monkeypatch.setattr(KVStore, "artifact_read",
                        lambda self, prefix_id, *a, **k: reads.append(prefix_id) or start(self, prefix_id, *a, **k))
    a_src, b_src, c_src = _source(store, pid), _source(store, pid), _source(store, other)
    a = TopK().selector(a_src, cfg)
    b = TopKToken().selector(b_src, cfg)  # the token-granular form over the same artifact shares it too
    c = TopK().selector(c_src, cfg)
    size = store.manifest(pid).artifact(KeyIndexSummarizer.name).size  # type: ignore[union-attr]
    assert reads == [pid, other]  # the second generation over pid read nothing...
    assert a_src.bytes_read == b_src.bytes_read == size and c_src.bytes_read > 0  # ...and is charged alike
    assert a.shared is b.shared and a.shared is not c.shared  # type: ignore[attr-defined]
    decoded = a.decoded  # type: ignore[attr-defined]
    assert decoded is not None and decoded is b.decoded  # type: ignore[attr-defined]
    idx = a.index  # type: ignore[attr-defined]
    keys = decoded.get(0, idx["0.codes"], idx["0.lo"], idx["0.step"], a.bits, a.block)  # type: ignore[attr-defined]
    again = b.decoded.get(0, idx["0.codes"], idx["0.lo"], idx["0.step"], b.bits, b.block)  # type: ignore[attr-defined]
    assert keys is again and decoded.nbytes == keys.numel() * 4  # decoded once, counted once
    key = a_src.shared_key(KeyIndexSummarizer.name)
    del a, keys, again
    gc.collect()
    assert shared_state.is_held(key)  # b still holds it
    del b, decoded
    gc.collect()
    assert not shared_state.is_held(key)
    d_src = _source(store, pid)
    TopK().selector(d_src, cfg)
    assert d_src.bytes_read == size  # read again: nothing held it


def test_two_generations_over_one_prefix_count_the_shared_index_apart(worker: Worker, store: KVStore) -> None:
    """Both generations report the key index (and whatever of its decoded keys existed when their memory peaked)
    as shared device bytes, not their own, and answer what each answers alone."""
    pid = worker.prefill(DOC).prefix_id
    index = TopK().selector(_source(store, pid), DecodeConfig(budget=0.2)).index  # type: ignore[attr-defined]
    index_bytes = sum(t.numel() * t.element_size() for t in index.values())
    del index
    gc.collect()
    params = SamplingParams(max_new_tokens=6)
    cfg = DecodeConfig(budget=0.2)
    want = "".join(worker.generate(pid, " Who counted?", params, method="topk", decode=cfg))
    stats = [GenerationStats(), GenerationStats()]
    streams = [worker.generate(pid, q, params, method="topk", decode=cfg, stats=s)
               for q, s in zip((" Who counted?", " What was written?"), stats, strict=True)]
    texts = ["".join(s) for s in streams]
    assert texts[0] == want
    for st in stats:
        assert st.extra["device_bytes_shared"] >= index_bytes  # the index itself is there from the open on
        assert st.extra["device_bytes"] == sum(st.extra[f"device_bytes_{p}"] for p in ("own_kv", "page_cache",
                                                                                          "method"))
