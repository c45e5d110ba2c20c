"""The page CRC kernel (``store/page_crc.cpp`` through ``store.page_crc_native``): zlib's CRC-32 values, each page's
keyed CRC equal to ``store.pages.page_crc``, and the Python loop (same values) where no kernel builds."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from test_store import _key, _kv

from native.build import CpuKernelBuild
from store import page_crc_native
from store.config import StoreConfig
from store.kvstore import KVStore
from store.page_crc_native import crc32, native_available, page_crcs
from store.pages import layer_file_name, pack_layer, page_crc

needs_kernel = pytest.mark.skipif(not native_available(), reason="no C++ compiler: the page CRC kernel is not built")


def _pages(count: int, page_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, page_bytes), dtype=np.uint8)


def _reference(prefix_id: str, layer: int, n_pages: int, first: int, rows: np.ndarray) -> np.ndarray:
    """One ``page_crc`` call per page (the definition)."""
    return np.array([page_crc(prefix_id, layer, *divmod(first + i, n_pages), rows[i].tobytes())
                     for i in range(rows.shape[0])], dtype=np.uint32)


@needs_kernel
@pytest.mark.parametrize("n", [0, 1, 3, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096, 8191, 8192 + 13])
def test_crc32_equals_zlib(n: int) -> None:
    """Every length around the 16- and 64-byte folding steps, from any start value, unaligned starts too."""
    data = _pages(1, n + 7, seed=n)[0]
    for value in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert crc32(data[:n], value) == zlib.crc32(data[:n].tobytes(), value)
    for off in (1, 7):
        assert crc32(data[off:off + n]) == zlib.crc32(data[off:off + n].tobytes())


@needs_kernel
@pytest.mark.parametrize(("prefix_id", "layer", "n_pages", "first", "count", "page_bytes"), [
    ("ab" * 16, 0, 1, 0, 1, 4096),            # one page
    ("ab" * 16, 5, 37, 0, 74, 8192),          # two whole heads, odd page count
    ("0f" * 16, 31, 5, 3, 29, 4096),          # starts mid-head, six heads
    ("0f" * 16, 7, 1000, 995, 12, 4096),      # page numbers across 999 -> 1000 and into the next head
    ("x", 123, 7, 0, 21, 100),                # a short id, a page size with a tail past the 16-byte folds
    ("y" * 64, 2, 3, 1, 5, 1),                # one-byte pages
])
def test_page_crcs_equal_page_crc(prefix_id: str, layer: int, n_pages: int, first: int, count: int,
                                  page_bytes: int) -> None:
    rows = _pages(count, page_bytes, seed=count)
    want = _reference(prefix_id, layer, n_pages, first, rows)
    assert np.array_equal(page_crcs(prefix_id, layer, n_pages, first, rows, page_bytes), want)
    assert np.array_equal(page_crcs(prefix_id, layer, n_pages, first, rows.tobytes(), page_bytes), want)
    assert np.array_equal(page_crcs(prefix_id, layer, n_pages, first, rows, page_bytes, native=False), want)


@needs_kernel
def test_large_page_numbers() -> None:
    """Page ids with many digits (the seed's decimal digits are computed in the kernel)."""
    rows = _pages(6, 64, seed=3)
    n_pages = 10**9
    first = 3 * n_pages - 3  # head 2's last three pages, then head 3's first three
    assert np.array_equal(page_crcs("ab" * 16, 9, n_pages, first, rows, 64),
                          _reference("ab" * 16, 9, n_pages, first, rows))


def test_no_kernel_without_a_compiler_or_when_disabled(tmp_path: Path) -> None:
    assert page_crc_native._load(CpuKernelBuild(compiler="kvstash-no-such-cxx", cache_dir=tmp_path)) is None
    assert page_crc_native._load(CpuKernelBuild(cache_dir=tmp_path, enabled=False)) is None  # KVSTASH_CPU_KERNEL=0
    assert not list(tmp_path.iterdir())  # nothing built


def test_the_fallback_gives_the_same_crcs(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _pages(10, 4096, seed=1)
    monkeypatch.setattr(page_crc_native, "_load", lambda config=None: None)
    assert np.array_equal(page_crcs("cd" * 16, 4, 3, 2, rows, 4096), _reference("cd" * 16, 4, 3, 2, rows))


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("n", [1, 17, 40])  # one page; a partial last page (zero-padded tokens)
def test_the_writers_crc_table_is_page_crc_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       kernel: bool, streamed: bool, n: int) -> None:
    """Both write paths (whole layers on the writer's threads, streamed bytes in pieces that split pages), with
    and without the kernel, record each page's ``page_crc`` of the bytes in its file."""
    if kernel and not native_available():
        pytest.skip("no C++ compiler")
    if not kernel:
        monkeypatch.setattr(page_crc_native, "_load", lambda config=None: None)
    store = KVStore(StoreConfig(home=tmp_path, page_size=16, fsync=False))
    key, kv = _key(n), _kv(n)
    with store.write_prefix(key, model_name="m", n_tokens=n) as w:
        for layer, (k, v) in enumerate(kv):
            if streamed:
                raw = pack_layer(key.layout, k, v).numpy().tobytes()
                stream = w.open_layer(layer)
                for lo in range(0, len(raw), 1500):  # pieces that split pages
                    stream.write(raw[lo:lo + 1500])
                stream.close()
            else:
                w.write_layer(layer, k, v)
        w.commit()
    table = store.page_crcs(key.prefix_id)
    lay = key.layout
    for layer in range(lay.n_layers):
        rows = np.fromfile(store.prefix_dir(key.prefix_id) / layer_file_name(layer), dtype=np.uint8)
        rows = rows.reshape(-1, lay.page_bytes)
        want = _reference(key.prefix_id, layer, lay.n_pages(n), 0, rows).reshape(lay.n_kv_heads, -1)
        assert np.array_equal(table[layer], want)
    k, _ = store.read_layer(key.prefix_id, 1, verify=True)
    assert torch.equal(k, kv[1][0])
    store.close()
