"""Summaries used as they arrive (``store.hashed_read.HashedRead``, ``workers.offload.streamed_summary``): a
layer's tensors before the rest of the file is read, the same tokens as reading the whole first, and damaged
bytes failing the generation before its first token."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from store import hashed_read
from store.artifacts import safetensors_layout
from store.disk_record import ArtifactRead, artifact_file_name
from store.errors import CorruptData
from store.hashed_read import HashedRead
from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods.quest import QuestBounds, StackedBounds
from workers.methods.source import PrefixSource
from workers.offload.streamed_summary import StreamedArtifact
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOC = "The vault code is 4411. The courier leaves from Lyon at dawn. " * 12
QUERY = " What is the vault code?"


def _slow_reads(monkeypatch: pytest.MonkeyPatch, delay: float) -> threading.Event:
    """Every read call sleeps ``delay`` first; the event is set while a read is still to come."""
    real = os.preadv

    def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
        time.sleep(delay)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow)
    return threading.Event()


def test_bytes_are_handed_out_before_the_whole_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 64
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    _slow_reads(monkeypatch, 0.05)
    r = HashedRead(path, len(data), chunk=1024, threads=1)  # 16 reads of 50 ms, one at a time
    assert r.wait_for(1024)
    assert bytes(r.buffer[:1024]) == data[:1024]
    assert not r._done  # the rest is still on its way
    buf, digest = r.result()
    assert bytes(buf) == data and digest is not None


def test_a_failed_read_reaches_the_waiters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096))

    def broken(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    r = HashedRead(path, 4096, chunk=1024)
    with pytest.raises(OSError, match="Input/output"):
        r.wait_for(10)
    with pytest.raises(OSError, match="Input/output"):
        r.result()


def _bounds_path(store: KVStore, pid: str) -> Path:
    m = store.manifest(pid)
    return store.prefix_dir(pid) / artifact_file_name([a.name for a in m.artifacts].index(QuestBounds.name))


def test_a_layers_bounds_come_before_the_later_layers_are_read(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    pid = worker.prefill(DOC).prefix_id
    m = worker.store.manifest(pid)
    size = m.artifact(QuestBounds.name).size
    monkeypatch.setattr(hashed_read, "READ_CHUNK", max(64, size // 16))
    monkeypatch.setattr(hashed_read, "READ_THREADS", 1)
    _slow_reads(monkeypatch, 0.05)
    source = PrefixSource(worker.store, m, torch.device("cpu"))
    source.stream_summaries = True
    streamed = source.artifact_streamed(QuestBounds.name)
    assert isinstance(streamed, StreamedArtifact)
    first = streamed["0.kmax"]
    assert not streamed._read._read._done  # layer 0's bounds are in while the file is still being read
    whole = worker.store.artifact(pid, QuestBounds.name)
    from store.artifacts import bytes_to_tensors

    assert torch.equal(first, bytes_to_tensors(whole)["0.kmax"])
    streamed.verify()


def test_streamed_bounds_give_the_tokens_of_reading_them_whole(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    pid = worker.prefill(DOC).prefix_id

    def tokens(cached: bool) -> list[int]:
        if not cached:
            worker.summaries.drop(pid)
        st = GenerationStats()
        "".join(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=8), method="quest",
                                decode=DecodeConfig(budget=0.3), stats=st))
        return st.token_ids

    streamed = tokens(cached=False)
    # Verified, the bounds went to the summary cache: the next generation reads none.
    assert worker.summaries.cached_tensors(worker.store.manifest(pid), QuestBounds.name) is not None
    again = tokens(cached=True)
    monkeypatch.setattr(PrefixSource, "artifact_streamed", lambda self, name: self.artifact(name))
    assert streamed == again == tokens(cached=False)


def test_damaged_bounds_fail_the_generation_before_its_first_token(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    path = _bounds_path(worker.store, pid)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # the last layer's bounds: read after the first layers were used
    path.write_bytes(raw)
    worker.summaries.drop(pid)
    st = GenerationStats()
    stream = worker.generate(pid, QUERY, SamplingParams(max_new_tokens=8), method="quest",
                             decode=DecodeConfig(budget=0.3), stats=st)
    pieces: list[str] = []
    with pytest.raises(CorruptData, match="checksum"):
        for piece in stream:
            pieces.append(piece)
    assert pieces == [] and st.token_ids == []
    assert worker.summaries.cached_tensors(worker.store.manifest(pid), QuestBounds.name) is None


def test_a_damaged_header_is_refused_at_open(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    path = _bounds_path(worker.store, pid)
    raw = bytearray(path.read_bytes())
    raw[8:10] = b"]]"  # the header's JSON no longer parses
    path.write_bytes(raw)
    worker.summaries.drop(pid)
    with pytest.raises(CorruptData):
        "".join(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=4), method="quest",
                                decode=DecodeConfig(budget=0.3)))


def test_stacked_bounds_serve_layer_0_before_the_file_is_read(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Making the selector's stacked bounds and scoring layer 0 wait for layer 0's bytes only (not for another
    layer's meta, say): the rest of the file may still be on its way."""
    pid = worker.prefill(DOC).prefix_id
    m = worker.store.manifest(pid)
    waited: list[int] = []
    real = ArtifactRead.wait_for

    def wait_for(self: ArtifactRead, end: int) -> None:
        waited.append(end)
        real(self, end)

    monkeypatch.setattr(ArtifactRead, "wait_for", wait_for)
    source = PrefixSource(worker.store, m, torch.device("cpu"))
    source.stream_summaries = True
    stacked = StackedBounds(source.artifact_streamed(QuestBounds.name))
    layer0 = stacked.get(0, 0, 1)
    spans = safetensors_layout(memoryview(worker.store.artifact(pid, QuestBounds.name)))
    assert max(waited) == max(spans[f"0.{n}"].end for n in ("meta", "kmax", "kmin"))
    assert max(waited) <= min(span.start for name, span in spans.items() if not name.startswith("0."))
    assert layer0.shape[-1] == 1 and stacked.page == QuestBounds.page_size
    stacked.verify()


def test_the_host_bytes_go_once_verified_and_every_layer_is_taken(worker: Worker) -> None:
    """Shared bounds live as long as their generations: the streamed artifact under them lets go of the host
    buffer once it is verified and every layer has been stacked (in either order), not before."""
    pid = worker.prefill(DOC).prefix_id
    source = PrefixSource(worker.store, worker.store.manifest(pid), torch.device("cpu"))
    source.stream_summaries = True
    for verify_first in (False, True):
        streamed = source.artifact_streamed(QuestBounds.name)
        assert isinstance(streamed, StreamedArtifact)
        stacked = StackedBounds(streamed)
        layers = worker.lm.layout.n_layers
        for layer in range(layers - 1):
            stacked.get(layer, 0, 1)
        if verify_first:
            stacked.verify()
        assert streamed.holds_bytes  # the last layer is still to come
        last = stacked.get(layers - 1, 0, 1)
        if not verify_first:
            assert streamed.holds_bytes  # every layer taken, not checked yet
            stacked.verify()
        assert not streamed.holds_bytes and last.shape[-1] == 1
        stacked.verify()  # again: nothing to do
