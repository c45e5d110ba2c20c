"""Artifacts written as they are produced, with bounded memory: ``KVStore.add_artifact`` of an iterable of chunks
(each on disk before the next is pulled; cap, quota and count refusals as they arrive, leaving nothing behind),
tensors serialized one at a time (``tensors_to_chunks``), and a prefill's summaries written once, layer by layer
(``LayerArtifact``), into artifacts that load as the gathered ones."""

from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_store import _key, _write, _written

from store import limits
from store.artifacts import bytes_to_tensors, digest, tensors_to_bytes, tensors_to_chunks
from store.config import StoreConfig
from store.errors import InvalidInput, QuotaExceeded
from store.kvstore import KVStore
from store.layer_artifact import MAX_PENDING_SUMMARY_LAYERS, LayerArtifact
from store.manifest import ArtifactInfo
from store.writer import ArtifactStream, PrefixWriter
from workers.engine import Worker
from workers.methods.base import Summarizer

CHUNK = 65_536
"""Larger than a file's write buffer: each written chunk is in the file at once."""


def _staged_sizes(store: KVStore) -> list[int]:
    """Sizes of the files staged in writers' temp dirs."""
    return [p.stat().st_size for p in store.prefixes_dir.glob(".tmp-*/*")]


def _prefix_state(store: KVStore, pid: str) -> tuple[object, list[str], list[str]]:
    """What a refused add must leave as it was: the manifest, the prefix directory, and the store's entries."""
    return (store.manifest(pid), sorted(p.name for p in store.prefix_dir(pid).iterdir()),
            sorted(p.name for p in store.prefixes_dir.iterdir()))


def test_add_artifact_writes_each_chunk_before_pulling_the_next(store: KVStore) -> None:
    pid, _ = _write(store, 40)
    data = os.urandom(5 * CHUNK + 17)
    seen: list[list[int]] = []

    def chunks() -> Iterator[bytes]:
        for off in range(0, len(data), CHUNK):
            seen.append(_staged_sizes(store))  # what is on disk when the next chunk is asked for
            yield data[off:off + CHUNK]

    m = store.add_artifact(pid, "streamed", chunks())
    assert seen == [[off] for off in range(0, len(data), CHUNK)]
    assert m.artifact("streamed") == ArtifactInfo(name="streamed", size=len(data), blake2b=digest(data))
    assert store.manifest(pid) == m and store.artifact(pid, "streamed") == data
    assert _staged_sizes(store) == [] and not list(store.prefixes_dir.glob(".tmp-*"))
    store.verify(pid)
    assert not store.check().problems


def _refusing_store(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> tuple[KVStore, str, int]:
    """A store holding one prefix whose next added artifact has room for ``room`` bytes (cap or tenant quota)."""
    monkeypatch.setattr(limits, "MIN_ARTIFACT_BUDGET", 0)  # the floor would hide the cap on a tiny prefix
    cfg = StoreConfig(home=tmp_path / "probe", page_size=16, fsync=False)
    probe = KVStore(cfg)
    m = probe.manifest(_write(probe, 40)[0])
    probe.close()
    cap_room = limits.max_added_artifact_bytes(m.kv_bytes) - m.artifact_bytes
    quota = m.kv_bytes + m.artifact_bytes + cap_room // 2 if case == "quota" else None
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16, fsync=False, max_bytes_per_tenant=quota))
    pid = _write(store, 40)[0]
    return store, pid, cap_room // 2 if case == "quota" else cap_room


@pytest.mark.parametrize("case", ["cap", "quota", "producer fails"])
def test_add_artifact_refused_mid_stream_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        case: str) -> None:
    """The chunk that would go past the prefix's cap or its tenant's byte quota is refused before it is written,
    the chunks after it are never pulled; a failing producer is the same: no file, no metadata change."""
    store, pid, room = _refusing_store(tmp_path, case, monkeypatch)
    before = _prefix_state(store, pid)
    piece, pulled = room // 3 + 1, [0]  # three pieces take one byte or more past the room

    def chunks() -> Iterator[bytes]:
        for i in range(10):
            if case == "producer fails" and i == 2:
                raise RuntimeError("the producer failed")
            pulled[0] += 1
            yield b"x" * piece

    error = {"cap": InvalidInput, "quota": QuotaExceeded, "producer fails": RuntimeError}[case]
    with pytest.raises(error, match={"cap": "does not fit", "quota": "exceed its quota",
                                     "producer fails": "failed"}[case]):
        store.add_artifact(pid, "cache", chunks())
    assert pulled[0] == (2 if case == "producer fails" else 3)
    assert _prefix_state(store, pid) == before and store.manifest(pid).artifact("cache") is None
    assert not store.check().problems
    data = b"y" * (room - 1)  # what fits, added after the refusal, is stored as such
    assert store.add_artifact(pid, "cache", data).artifact("cache") == ArtifactInfo(name="cache", size=len(data),
                                                                                   blake2b=digest(data))
    assert store.artifact(pid, "cache") == data
    store.close()


def test_add_artifact_pulls_nothing_when_committed_or_over_the_count(store: KVStore) -> None:
    """First writer wins without pulling a chunk, and so does the count refusal; streamed adds fill up to it."""
    pid, _ = _write(store, 40)
    pulled: list[str] = []

    def chunks(name: str) -> Iterator[bytes]:
        pulled.append(name)
        yield name.encode()

    m = store.manifest(pid)
    for i in range(limits.MAX_ARTIFACTS - len(m.artifacts)):
        m = store.add_artifact(pid, f"a{i}", chunks(f"a{i}"))
    assert len(m.artifacts) == limits.MAX_ARTIFACTS and store.artifact(pid, "a3") == b"a3"
    n = len(pulled)
    assert store.add_artifact(pid, "a0", chunks("again")) == m
    with pytest.raises(InvalidInput, match=f"at most {limits.MAX_ARTIFACTS} artifacts"):
        store.add_artifact(pid, "one too many", chunks("one too many"))
    assert len(pulled) == n and store.manifest(pid) == m


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"1.max": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16), "0.min": torch.randn(3, generator=g),
            "10.ids": torch.arange(5, dtype=torch.int32), "2.f64": torch.randn(2, 2, generator=g).double(),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5), "t": torch.randn(4, 5, generator=g).t(),
            "mask": torch.tensor([True, False, True]), "half": torch.randn(7, generator=g).half(),
            "long": torch.arange(3), "u8": torch.arange(9, dtype=torch.uint8)}


def test_tensor_chunks_are_the_bytes_of_tensors_to_bytes() -> None:
    """Header and layout as safetensors makes them (widest dtype first, then by name), one tensor per chunk."""
    tensors = _tensors()
    chunks = list(tensors_to_chunks(tensors))
    assert len(chunks) == 1 + len(tensors) and b"".join(bytes(c) for c in chunks) == tensors_to_bytes(tensors)


def _layer(layer: int, rows: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    return {"min": torch.randn(2, rows, generator=g), "ids": torch.arange(rows, dtype=torch.int32) + layer,
            "half": torch.randn(rows, generator=g).half(), "meta": torch.tensor([layer, rows])}


@contextlib.contextmanager
def _layer_stream(store: KVStore, name: str = "summary") -> Iterator[tuple[PrefixWriter, ArtifactStream]]:
    """A prefix writer (never committed: aborted on exit) and its stream for one artifact."""
    with store.write_prefix(_key(8), model_name="m", n_tokens=8, tenant="t") as w:
        yield w, w.open_artifact(name)


def test_layer_artifact_writes_layers_once_into_one_safetensors_file(store: KVStore) -> None:
    """Layers added one at a time make one file that loads as every layer's tensors, laid out layer after layer
    (the header comes from layer 0), with the digest of its bytes; nothing else is left in the temp dir."""
    with _layer_stream(store) as (w, stream):
        with LayerArtifact(stream, 3, max_pending=1) as out:
            for layer in range(3):
                out.add(layer, _layer(layer))
        staged, info = w._artifacts["summary"]
        data = (w.tmp_dir / staged).read_bytes()
        assert info.size == len(data) and info.blake2b == digest(data)
        back = bytes_to_tensors(data)
        want = {f"{ly}.{n}": t for ly in range(3) for n, t in _layer(ly).items()}
        assert back.keys() == want.keys() and all(torch.equal(back[n], want[n]) for n in want)
        hlen = int.from_bytes(data[:8], "little")
        import json

        offsets = {n: e["data_offsets"][0] for n, e in json.loads(data[8:8 + hlen]).items()}
        assert [n.split(".")[0] for n in sorted(offsets, key=offsets.__getitem__)] == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
        assert _written(w.tmp_dir) == [staged]


@pytest.mark.parametrize("bad", ["shape", "name", "order", "missing"])
def test_layer_artifact_refuses_a_layer_unlike_layer_0_and_leaves_nothing(store: KVStore, bad: str) -> None:
    """A later layer with another shape or set of tensors, a layer out of order, or a close before every layer came
    is InvalidInput, and the staged file is gone."""
    with _layer_stream(store) as (w, stream):
        out = LayerArtifact(stream, 3)
        with pytest.raises(InvalidInput), out:
            out.add(0, _layer(0))
            if bad == "shape":
                out.add(1, _layer(1, rows=4))
            elif bad == "name":
                out.add(1, {**_layer(1), "extra": torch.zeros(1)})
            elif bad == "order":
                out.add(2, _layer(2))
            else:
                out.add(1, _layer(1))
                out.close()
        assert _written(w.tmp_dir) == [] and "summary" not in w._artifacts


def test_layer_artifact_write_refused_by_the_budget_surfaces_and_leaves_nothing(store: KVStore,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """A background write past the prefix's artifact budget is raised to the caller (at a later add or at close),
    and the staged file is gone."""
    monkeypatch.setattr("store.writer.max_artifact_bytes", lambda page_bytes: 600)
    with _layer_stream(store) as (w, stream):
        out = LayerArtifact(stream, 50, max_pending=1)
        with pytest.raises(InvalidInput, match="at most 600 bytes"), out:
            for layer in range(50):
                out.add(layer, _layer(layer, rows=4))
        assert _written(w.tmp_dir) == []


class _SlowFile:
    """A file whose writes sleep first (releasing the GIL)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def write(self, data: bytes) -> int:
        """Sleep a millisecond, then write."""
        time.sleep(0.001)
        return self._inner.write(data)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_concurrent_artifact_streams_claim_the_budget_atomically(store: KVStore,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams written from several threads at once never take the artifacts past the budget together: each write's
    room is checked and claimed in one step (a refused stream is discarded and gives its room back)."""
    import threading

    budget, chunk, chunks = 64 * 1024, 512, 32  # four streams want the budget, which the page checksums share
    monkeypatch.setattr("store.writer.max_artifact_bytes", lambda page_bytes: budget)
    with _layer_stream(store, "s0") as (w, _):
        streams = [w._artifact_streams["s0"]] + [w.open_artifact(f"s{i}") for i in range(1, 4)]
        for s in streams:  # a write that gives up the GIL, as a large one does: the other threads run meanwhile
            s._file = _SlowFile(s._file)  # type: ignore[assignment]
        start = threading.Barrier(len(streams))

        def fill(stream: ArtifactStream) -> None:
            start.wait()
            with contextlib.suppress(InvalidInput):
                for _ in range(chunks):
                    stream.write(b"x" * chunk)

        threads = [threading.Thread(target=fill, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        kept = [s.written for s in streams if s.name in w._artifact_streams]
        assert len(kept) < len(streams) and sum(kept) + w._crc.nbytes <= budget


class _Tracked:
    """A prefill summarizer's outputs, handed on in numpy-backed tensors whose arrays the test watches (each dies
    once nothing holds its tensor), and copied for the test (``gathered``)."""

    def __init__(self, inner: Summarizer, arrays: dict[int, list[weakref.ref]], alive: list[tuple[int, int]],
                 gathered: dict[str, dict[str, torch.Tensor]]) -> None:
        self.inner, self.name, self.version = inner, inner.name, inner.version
        self._arrays, self._alive, self._gathered = arrays, alive, gathered

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inner summaries; first notes how many arrays of earlier layers are still alive."""
        gc.collect()
        self._alive.append((layer, sum(r() is not None for ly, refs in self._arrays.items() if ly < layer
                                       for r in refs)))
        out = {}
        for name, t in self.inner.summarize(layer, k, v).items():
            host = t.detach().cpu().contiguous()
            self._gathered.setdefault(self.name, {})[f"{layer}.{name}"] = host.clone()
            arr = np.array(host.reshape(-1).view(torch.uint8).numpy())  # the only holder of these bytes
            self._arrays.setdefault(layer, []).append(weakref.ref(arr))
            out[name] = torch.from_numpy(arr).view(t.dtype).reshape(t.shape)
        return out


def test_prefill_summaries_are_written_layer_by_layer(worker: Worker, store: KVStore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``MAX_PENDING_SUMMARY_LAYERS`` earlier layers' summaries are held when a layer is summarized, and each
    summary artifact loads as every layer's tensors (what gathering them all at the end gives)."""
    import workers.engine as engine

    arrays: dict[int, list[weakref.ref]] = {}
    alive: list[tuple[int, int]] = []
    gathered: dict[str, dict[str, torch.Tensor]] = {}
    real = engine.build_summarizers
    monkeypatch.setattr(engine, "build_summarizers",
                        lambda phi_map=None, **kw: [_Tracked(s, arrays, alive, gathered) for s in real(phi_map, **kw)])
    pid = worker.prefill("The quick brown fox jumps over the lazy dog. " * 6).prefix_id
    n_layers = worker.lm.layout.n_layers
    assert n_layers >= 2 and {layer for layer, _ in alive} == set(range(n_layers))
    per_layer = len(arrays[0])
    assert all(n <= MAX_PENDING_SUMMARY_LAYERS * per_layer for _, n in alive), alive
    assert gathered and all(len(t) >= n_layers for t in gathered.values())
    for name, tensors in gathered.items():
        back = bytes_to_tensors(store.artifact(pid, name))
        assert back.keys() == tensors.keys() and all(torch.equal(back[n], tensors[n]) for n in tensors)
    store.verify(pid)


@pytest.mark.parametrize("sync_after_commit", [False, True])
def test_layer_artifact_makes_each_layer_durable_as_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   sync_after_commit: bool) -> None:
    """Every layer's bytes are synced to the disk once written (not all at close) when the store fsyncs before
    the commit; none is when it fsyncs after the commit (the prefill does not wait for the disk)."""
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16, sync_after_commit=sync_after_commit))
    assert store.config.fsync
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    with _layer_stream(store) as (w, stream):
        out = LayerArtifact(stream, 3, max_pending=1)
        for layer in range(3):
            out.add(layer, _layer(layer))
        out.close()
    store.close()
    if sync_after_commit:
        assert synced == []
    else:
        assert len(synced) == 3 and synced == sorted(synced) and synced[0] > 0
