"""Artifacts read whole while hashed (``store.hashed_read``), parsed as views of the read buffer
(``bytes_to_tensors`` of a bytearray), and the store's artifact reads built on them: the same digests,
tensors and refusals as reading then hashing, then parsing with safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from test_store import _key, _kv

from store import hashed_read
from store.artifacts import bytes_to_tensors, tensors_to_bytes
from store.config import StoreConfig
from store.disk_record import artifact_file_name
from store.errors import CorruptData, InvalidInput
from store.hashed_read import read_hashed
from store.kvstore import KVStore


def _b2(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _file(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 64, 1000])
@pytest.mark.parametrize(("chunk", "threads"), [(1, 1), (8, 3), (7, 16), (4096, 4)])
def test_digest_and_bytes_equal_a_plain_read(tmp_path: Path, size: int, chunk: int, threads: int) -> None:
    data = (bytes(range(256)) * 4)[:size]
    got, dig = read_hashed(_file(tmp_path, data), size, chunk=chunk, threads=threads)
    assert bytes(got) == data
    assert dig == _b2(data)


@pytest.mark.parametrize(("chunk", "threads"), [(1, 2), (5, 4), (30, 2), (4096, 4)])
def test_a_short_or_long_file_has_no_digest(tmp_path: Path, chunk: int, threads: int) -> None:
    data = bytes(range(100))
    path = _file(tmp_path, data)
    short, dig = read_hashed(path, 131, chunk=chunk, threads=threads)
    assert (bytes(short), dig) == (data, None)
    long_, dig = read_hashed(path, 99, chunk=chunk, threads=threads)
    assert (bytes(long_), dig) == (data[:99], None)


def test_a_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_hashed(tmp_path / "none", 10)


def test_several_reads_are_in_flight_while_the_caller_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The reads run on the pool's threads, more than one at a time (the overlap being bought)."""
    import threading
    import time

    real, lock = os.preadv, threading.Lock()
    live, peak, names = [0], [0], set()

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            names.add(threading.current_thread().name)
        time.sleep(0.02)
        try:
            return real(fd, buffers, offset)
        finally:
            with lock:
                live[0] -= 1

    data = bytes(range(256)) * 40
    path = _file(tmp_path, data)
    monkeypatch.setattr(os, "preadv", slow_preadv)
    got, dig = read_hashed(path, len(data), chunk=1000, threads=4)
    assert bytes(got) == data and dig == _b2(data)
    assert peak[0] > 1 and all(n.startswith("kvstash-read") for n in names), (peak, names)


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16, torch.bfloat16,
          torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64]


def test_a_bytearray_parses_to_views_equal_to_safetensors() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.rand(3, 5, generator=g) * 100).to(d) for i, d in enumerate(DTYPES)}
    tensors |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "long": torch.arange(1001)}
    data = tensors_to_bytes(tensors)
    ref = bytes_to_tensors(data)  # bytes: safetensors' own parser
    buf = bytearray(data)
    got = bytes_to_tensors(buf)
    assert got.keys() == ref.keys() == tensors.keys()
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    buf[-8:] = bytes(8)  # views, not copies: the last tensor's bytes change with the buffer
    last = max(json.loads(bytes(buf[8:8 + struct.unpack("<Q", buf[:8])[0]])).items(),
               key=lambda kv: kv[1]["data_offsets"][1])[0]
    assert not torch.equal(got[last], ref[last])


def _with_header(header: dict, body: bytes) -> bytearray:
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + body)


@pytest.mark.parametrize("bad", [
    bytearray(b"1234"),  # shorter than the length field
    bytearray(struct.pack("<Q", 1 << 40) + b"{}"),  # header longer than the buffer
    bytearray(struct.pack("<Q", 2) + b"[]"),  # not an object
    bytearray(struct.pack("<Q", 3) + b"{x}"),  # not JSON
    _with_header({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
    _with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),  # size mismatch
    _with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(4)),  # past the end
    _with_header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""),
    _with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, bytes(4)),
    _with_header({"a": {"dtype": "F32"}}, b""),  # fields missing
    _with_header({"a": 3}, b""),
])
def test_a_malformed_buffer_is_refused(bad: bytearray) -> None:
    with pytest.raises(InvalidInput):
        bytes_to_tensors(bad)


def test_a_read_only_view_is_refused() -> None:
    with pytest.raises(InvalidInput, match="read-only"):
        bytes_to_tensors(memoryview(tensors_to_bytes({"a": torch.ones(2)})))


def test_store_artifacts_read_whole_hashed_and_refused_when_damaged(tmp_path: Path) -> None:
    """More bytes than one read chunk: the store's reads go through the overlapped path."""
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16))
    big = {"x": torch.arange(3 * hashed_read.READ_CHUNK // 8 + 5, dtype=torch.int64)}
    key, kv = _key(20), _kv(20)
    with store.write_prefix(key, model_name="m", n_tokens=20) as w:
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.put_artifact("big", tensors_to_bytes(big))
        w.commit()
    pid = key.prefix_id
    got = store.artifact(pid, "big")
    assert isinstance(got, bytearray)
    assert torch.equal(bytes_to_tensors(got)["x"], big["x"])
    crcs = store.page_crcs(pid)
    assert crcs.shape == (3, 2, 2) and not crcs.flags.writeable  # shared by the decode path's callers
    m = store.manifest(pid)
    path = store.prefix_dir(pid) / artifact_file_name([a.name for a in m.artifacts].index("big"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    with pytest.raises(CorruptData, match="checksum"):
        store.artifact(pid, "big")
    raw[-1] ^= 1
    path.write_bytes(raw + b"!")
    with pytest.raises(CorruptData, match="bytes long"):
        store.artifact(pid, "big")
    path.write_bytes(raw[:-1])
    with pytest.raises(CorruptData, match="bytes long"):
        store.artifact(pid, "big")
