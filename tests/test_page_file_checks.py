"""One integrity check per page file: new page files carry no blake2b of their whole, their keyed page CRCs (the
``page_crc`` artifact, itself under a blake2b) cover every byte. A flipped byte anywhere in a page file is found by
every path that checks a whole file (``verify``, ``check``, the recovery of an unsynced directory, the host tier's
warm-up, a verified layer read), for new manifests and for those written before (a blake2b per page file)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import open_store, write_prefix
from test_store import _key, _kv, _write
from test_store_background_sync import Gates, _after_crash, _crash, _open

from store import disk_record, page_io, recovery
from store.errors import CorruptData, PrefixNotFound
from store.kvstore import KVStore
from store.manifest import FILE_DIGEST, PAGE_CRCS, FileInfo, Manifest
from store.pages import file_digest, layer_file_name, pack_layer
from workers.offload import HostTier, OffloadConfig, PageFetcher

FORMATS = ["page_crc", "blake2b"]
"""A manifest this code writes, and one written before (page files with a blake2b digest each)."""


@pytest.fixture()
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gates]:
    g = Gates(monkeypatch)
    yield g
    g.open_all()


def _flip(path: Path, offset: int) -> None:
    """Invert one byte of ``path`` (a negative offset counts from the end)."""
    size = path.stat().st_size
    offset %= size
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def old_format_json(m: Manifest, directory: Path) -> str:
    """The manifest JSON the code before version 2 wrote for ``m``'s files: version 1, a blake2b per page file."""
    d = json.loads(m.to_json())
    d["version"] = 1
    d["files"] = [{"name": f.name, "size": f.size, "blake2b": file_digest(directory / f.name)} for f in m.files]
    return json.dumps(d, sort_keys=True)


def as_old_format(store: KVStore, prefix_id: str) -> Manifest:
    """Rewrite a committed prefix's manifest (its directory's and the metadata's) as one written before."""
    d = store.prefix_dir(prefix_id)
    text = old_format_json(store.manifest(prefix_id), d)
    old = Manifest.from_json(text)
    assert all(f.check == FILE_DIGEST and f.blake2b for f in old.files)
    assert old.to_json() == text  # an old manifest is written back byte for byte as it was
    disk_record.publish(d, old, fsync=False)
    store._meta.commit(old)
    return old


def _prefix(store: KVStore, fmt: str, n: int = 40, seed: int = 0) -> str:
    pid, _ = _write(store, n, seed=seed)
    if fmt == "blake2b":
        as_old_format(store, pid)
    return pid


OFFSETS = [0, 2049, -1]
"""A page's first byte, one in a page's V block, the file's last byte (padding of the last page)."""


def test_new_page_files_carry_no_digest(tmp_path: Path) -> None:
    store = _open(tmp_path)
    pid, _ = _write(store, 40)
    m = store.manifest(pid)
    assert all(f.check == PAGE_CRCS and f.blake2b == "" for f in m.files)
    text = m.to_json()
    assert json.loads(text)["version"] == 2 and Manifest.from_json(text) == m
    assert disk_record.read_manifest(store.prefix_dir(pid)) == m
    store.close()


def test_fileinfo_takes_a_digest_with_its_check_only() -> None:
    FileInfo(name="layer_000.kv", size=1, blake2b="ab")
    FileInfo(name="layer_000.kv", size=1, check=PAGE_CRCS)
    for bad in (dict(blake2b=""), dict(blake2b="ab", check=PAGE_CRCS), dict(blake2b="ab", check="md5")):
        with pytest.raises(ValueError):
            FileInfo(name="layer_000.kv", size=1, **bad)  # type: ignore[arg-type]


class _Counted:
    """``hashlib.blake2b`` counting every byte any of its objects hashes."""

    def __init__(self) -> None:
        self.bytes = 0
        self._real = hashlib.blake2b

    def __call__(self, data: Any = b"", **kw: Any) -> Any:
        outer = self
        h = self._real(**kw)

        class Spy:
            def update(self, chunk: Any) -> None:
                outer.bytes += memoryview(chunk).nbytes
                h.update(chunk)

            def hexdigest(self) -> str:
                return h.hexdigest()

        spy = Spy()
        spy.update(data)
        return spy


@pytest.mark.parametrize("streamed", [False, True])
def test_the_writer_hashes_no_page_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool) -> None:
    """Both write paths: blake2b sees the artifacts (the CRC table, ``extra``) and the manifest, never page files."""
    counted = _Counted()
    monkeypatch.setattr(hashlib, "blake2b", counted)
    store = open_store(tmp_path)
    n = 400
    key, kv = _key(n), _kv(n)
    with store.write_prefix(key, model_name="m", n_tokens=n) as w:
        for layer, (k, v) in enumerate(kv):
            if streamed:
                stream = w.open_layer(layer)
                stream.write(pack_layer(key.layout, k, v).numpy().tobytes())
                stream.close()
            else:
                w.write_layer(layer, k, v)
        m = w.commit()
    assert 0 < counted.bytes < m.files[0].size  # not even one page file's bytes
    store.verify(key.prefix_id)
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_verify_and_check_find_a_flipped_byte(tmp_path: Path, fmt: str, offset: int) -> None:
    store = _open(tmp_path)
    pid = _prefix(store, fmt)
    other = _prefix(store, fmt, seed=7)
    store.verify(pid)
    assert store.check().ok
    _flip(store.prefix_dir(pid) / layer_file_name(1), offset)
    with pytest.raises(CorruptData, match="layer_001.kv|layer 1"):
        store.verify(pid)
    report = store.check()
    assert report.names(recovery.CORRUPT) == [pid]
    assert store.check(hash_pages=False).ok  # the quick check reads no page
    store.verify(other)
    store.close()


@pytest.mark.parametrize("offset", OFFSETS)
def test_without_the_kernel_verify_finds_a_flipped_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       offset: int) -> None:
    """Where no kernel builds, the whole-file check runs on ``verify_pages`` (chunk CRCs) and names the page."""
    monkeypatch.setattr(page_io, "native_available", lambda: False)
    store = _open(tmp_path)
    pid = _prefix(store, "page_crc")
    store.verify(pid)
    _flip(store.prefix_dir(pid) / layer_file_name(0), offset)
    with pytest.raises(CorruptData, match="layer 0 head [01] page [0-2] failed"):
        store.verify(pid)
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lost_crc_table_fails_the_check(tmp_path: Path, fmt: str) -> None:
    """The CRC table's own digest guards it: a flipped byte there fails ``verify`` in either format."""
    store = _open(tmp_path)
    pid = _prefix(store, fmt)
    m = store.manifest(pid)
    index = [a.name for a in m.artifacts].index("page_crc")
    _flip(store.prefix_dir(pid) / disk_record.artifact_file_name(index), 5)
    with pytest.raises(CorruptData, match="page_crc"):
        store.verify(pid)
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_recovery_of_an_unsynced_directory_finds_a_flipped_byte(tmp_path: Path, gates: Gates, fmt: str,
                                                                offset: int) -> None:
    home = tmp_path / "home"
    crashed = _open(home)
    pid = _prefix(crashed, fmt)
    kept = _prefix(crashed, fmt, seed=3)
    assert disk_record.is_marked_unsynced(crashed.prefix_dir(pid))
    _flip(crashed.prefix_dir(pid) / layer_file_name(2), offset)
    _crash(crashed)
    restarted = _open(home)
    assert not restarted.prefix_dir(pid).exists()
    with pytest.raises(PrefixNotFound):
        restarted.manifest(pid)
    restarted.verify(kept)
    assert restarted.manifest(kept).files[0].check == (FILE_DIGEST if fmt == "blake2b" else PAGE_CRCS)
    _after_crash(crashed, gates)
    restarted.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_the_host_warm_up_and_verified_reads_find_a_flipped_byte(tmp_path: Path, fmt: str, offset: int) -> None:
    store = open_store(tmp_path)
    m, _ = write_prefix(store, 70)
    if fmt == "blake2b":
        m = as_old_format(store, m.prefix_id)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=8 * m.kv_bytes)
    with PageFetcher(store, m, "cpu", OffloadConfig(gpu_cache_bytes=1 << 20), tier) as f:
        assert f.warm_host() > 0  # whole: warms
    _flip(store.prefix_dir(m.prefix_id) / layer_file_name(0), offset)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=8 * m.kv_bytes)
    with PageFetcher(store, m, "cpu", OffloadConfig(gpu_cache_bytes=1 << 20), tier) as f, \
            pytest.raises(CorruptData, match="layer 0"):
        f.warm_host()
    with pytest.raises(CorruptData, match="layer 0"):
        store.read_layer(m.prefix_id, 0, verify=True)
    store.close()


def test_an_old_manifest_loads_from_its_directory(tmp_path: Path) -> None:
    """A directory committed by the code before (version 1 manifest) is registered again from its files when the
    metadata is lost, keeps its digests, and verifies."""
    store = _open(tmp_path)
    pid = _prefix(store, "blake2b")
    old = store.manifest(pid)
    store._meta.delete(pid)
    report = store.recover()
    assert report.names(recovery.UNREGISTERED) == [pid]
    assert store.manifest(pid) == old and all(f.check == FILE_DIGEST for f in old.files)
    store.verify(pid)
    store.close()
