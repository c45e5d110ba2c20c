"""Fail closed: truncated or missing files, flipped bytes, I/O errors, short reads and pages of another
prefix (or another place) raise CorruptData; nothing half-fetched is served afterwards."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_helpers import LAYERS, PAGE, gather_rows, layer_path, open_store, page_tokens, write_prefix

from store.errors import CorruptData
from store.kvstore import KVStore
from workers.offload import HostTier, OffloadConfig, PageFetcher

N = PAGE * 12


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "home")
    yield s
    s.close()


def _fetcher(store: KVStore, m, *, verify: bool = True, host: HostTier | None = None) -> PageFetcher:
    cfg = OffloadConfig(gpu_cache_bytes=8 * LAYERS * m.layout.page_payload_bytes, verify=verify, io_threads=1)
    return PageFetcher(store, m, "cpu", cfg, host)


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_file_raises(store: KVStore) -> None:
    m, _ = write_prefix(store, N)
    path = layer_path(store, m, 1)
    os.truncate(path, path.stat().st_size - m.layout.page_bytes // 2)
    with _fetcher(store, m) as f:
        f.fetch(0, torch.tensor([[0], [1]]))  # other layers are fine
        with pytest.raises(CorruptData, match="truncated"):
            f.fetch(1, torch.tensor([[0], [1]]))


def test_missing_file_raises(store: KVStore) -> None:
    m, _ = write_prefix(store, N)
    layer_path(store, m, 2).unlink()
    with _fetcher(store, m) as f, pytest.raises(CorruptData, match="missing"):
        f.fetch(2, torch.tensor([[0], [1]]))


def test_flipped_byte_raises_with_verification(store: KVStore) -> None:
    m, _ = write_prefix(store, N)
    lay = m.layout
    off = lay.page_offset(1, 4, N) + 100
    raw = bytearray(layer_path(store, m, 0).read_bytes()[off : off + 1])
    _patch(layer_path(store, m, 0), off, bytes([raw[0] ^ 0x40]))
    with _fetcher(store, m) as f:
        f.fetch(0, torch.tensor([[4], [3]]))  # head 0 page 4 and head 1 page 3 are intact
        with pytest.raises(CorruptData, match="layer 0 head 1 page 4"):
            f.fetch(0, torch.tensor([[4], [4]]))
    with _fetcher(store, m, verify=False) as f:  # sizes are still checked; contents only with verify
        f.fetch(0, torch.tensor([[4], [4]]))


@pytest.mark.parametrize("same_prefix", [False, True])
def test_page_from_elsewhere_raises(store: KVStore, same_prefix: bool) -> None:
    m, _ = write_prefix(store, N)
    lay = m.layout
    if same_prefix:  # head 0 page 7 of the same layer file put where head 1 page 2 belongs
        donor, src_off = layer_path(store, m, 0), lay.page_offset(0, 7, N)
    else:  # the same (layer, head, page) of another prefix with the same layout
        other, _ = write_prefix(store, N, seed=9)
        donor, src_off = layer_path(store, other, 0), lay.page_offset(1, 2, N)
    page = donor.read_bytes()[src_off : src_off + lay.page_bytes]
    _patch(layer_path(store, m, 0), lay.page_offset(1, 2, N), page)
    with _fetcher(store, m) as f, pytest.raises(CorruptData, match="head 1 page 2"):
        f.fetch(0, torch.tensor([[0, 1, 2], [1, 2, 3]]))


def test_io_error_raises_clearly(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = write_prefix(store, N)

    def fail(fd: int, bufs: list, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with _fetcher(store, m) as f:
        monkeypatch.setattr(os, "preadv", fail)
        with pytest.raises(CorruptData, match="I/O error reading layer_000.kv"):
            f.fetch(0, torch.tensor([[0], [1]]))


def test_short_read_raises(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = write_prefix(store, N)
    real = os.preadv
    with _fetcher(store, m) as f:
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: min(real(fd, bufs, off), 100) if off else 0)
        with pytest.raises(CorruptData, match="short read"):
            f.fetch(0, torch.tensor([[0, 1], [1, 2]]))


def test_failed_fetch_serves_nothing_stale_afterwards(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed fetch the layer's cache is empty and the host tier holds no page of the failed read."""
    m, kv = write_prefix(store, N)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=100 * m.layout.page_bytes)
    real = os.preadv
    with _fetcher(store, m, host=tier) as f:
        f.fetch(1, torch.tensor([[0, 1], [2, 3]]))
        monkeypatch.setattr(os, "preadv", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "boom")))
        with pytest.raises(CorruptData):
            f.fetch(1, torch.tensor([[5, 6], [7, 8]]))
        assert tier.used_bytes == 4 * m.layout.page_bytes  # the failed pages never entered the tier
        assert (f._layers[1].slot_map == -1).all()
        monkeypatch.setattr(os, "preadv", real)
        pages = torch.tensor([[0, 6], [2, 8]])
        r = f.fetch(1, pages)
        tok, ok = page_tokens(pages, N)
        assert torch.equal(gather_rows(r.k, r.token_rows(tok)), gather_rows(kv[1][0], tok))
        assert f.stats.per_step[-1].host_pages == 2 and f.stats.per_step[-1].gpu_hits == 0


def test_manifest_size_mismatch_raises_at_open(store: KVStore) -> None:
    m, _ = write_prefix(store, N)
    bad = type(m)(**{**m.__dict__, "n_tokens": N + PAGE})
    with pytest.raises(CorruptData, match="do not match"):
        _fetcher(store, bad)
