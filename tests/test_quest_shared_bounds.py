"""Generations over one stored prefix share Quest's stacked page bounds (read once, held once on the device)."""

from __future__ import annotations

import gc

import pytest
import torch

from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods import shared_state
from workers.methods.quest import Quest, QuestBounds
from workers.methods.source import PrefixSource
from workers.requests import DecodeConfig

DOC = "The lighthouse keeper counted ships until dawn, then wrote their names in a ledger. " * 12


def _source(store: KVStore, pid: str) -> PrefixSource:
    return PrefixSource(store, store.manifest(pid), torch.device("cpu"))


def test_generations_over_one_prefix_share_its_stacked_bounds(worker: Worker, store: KVStore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second generation reads no bounds and scores against the first one's stacked tensors; another prefix
    gets its own; once no generation holds them they are freed."""
    pid = worker.prefill(DOC).prefix_id
    other = worker.prefill(DOC + " And the sea was calm.").prefix_id
    cfg = DecodeConfig(budget=0.2)
    reads: list[str] = []
    start = KVStore.artifact_read
    monkeypatch.setattr(KVStore, "artifact_read",
                        lambda self, prefix_id, *a, **k: reads.append(prefix_id) or start(self, prefix_id, *a, **k))
    a_src, b_src, c_src = _source(store, pid), _source(store, pid), _source(store, other)
    a = Quest().selector(a_src, cfg)
    b = Quest().selector(b_src, cfg)
    c = Quest().selector(c_src, cfg)
    size = store.manifest(pid).artifact(QuestBounds.name).size  # type: ignore[union-attr]
    assert reads == [pid, other]  # the second generation over pid read nothing...
    assert a_src.bytes_read == b_src.bytes_read == size and c_src.bytes_read > 0  # ...and is charged alike
    assert a.stacked is b.stacked and a.stacked is not c.stacked  # type: ignore[attr-defined]
    pages = a.stacked.bounds["0.kmax"].shape[1]  # type: ignore[attr-defined]  # before layer 0 is stacked
    t = a._bounds_t(0, 0, pages)  # type: ignore[attr-defined]
    assert b._bounds_t(0, 0, pages).data_ptr() == t.data_ptr()  # type: ignore[attr-defined]
    narrower = b._bounds_t(0, 1, pages - 2)  # type: ignore[attr-defined]  # another config's page range: a view
    assert narrower.data_ptr() == t.data_ptr() + t.element_size() and torch.equal(narrower, t[..., 1:pages - 2])
    key = a_src.shared_key(QuestBounds.name)
    del a, t
    gc.collect()
    assert shared_state.is_held(key)  # b still holds them
    del b
    gc.collect()
    assert not shared_state.is_held(key)
    d_src = _source(store, pid)
    Quest().selector(d_src, cfg)
    assert d_src.bytes_read == size  # read again: nothing held them
