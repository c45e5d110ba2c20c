"""Batched keyed-CRC verification (``store.crc_batch`` via ``page_io.verify_pages``) against the per-page
definition: every page read back intact passes, and any corrupt, swapped or foreign page fails naming
the first bad page exactly as a page-by-page check would."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from store import page_io
from store.crc32 import crc32
from store.crc_batch import chunk_crc, expected_chunk_crcs, page_seeds
from store.errors import CorruptData
from store.page_io import verify_pages
from store.pages import page_crc, page_crc_seed

PID = "0123456789abcdef0123456789abcdef"


def _pages(n_heads: int, n_pages: int, page_bytes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random page bytes ``[heads * pages, page_bytes]`` and their keyed CRCs ``[heads, pages]`` (layer 3)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_heads * n_pages, page_bytes), dtype=np.uint8)
    crcs = np.array([[page_crc(PID, 3, h, p, raw[h * n_pages + p].data) for p in range(n_pages)]
                     for h in range(n_heads)], dtype=np.uint32)
    return raw, crcs


def test_the_crc_in_use_is_zlibs() -> None:
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    assert all(crc32(data[:n], s) == zlib.crc32(data[:n], s) for n in (0, 1, 5000, 6000, 100_000)
               for s in (0, 1, 0xFFFFFFFF, 0x12345678))


def test_vectorized_seeds_equal_the_definition() -> None:
    pages = np.array([0, 1, 9, 10, 11, 99, 100, 101, 999, 1000, 65535, 123456, 10**9, 10**12])
    heads = np.arange(pages.size) % 5
    got = page_seeds(PID, 17, heads, pages)
    assert got.tolist() == [page_crc_seed(PID, 17, int(h), int(p)) for h, p in zip(heads, pages)]


@pytest.mark.parametrize("page_bytes", [4096, 8192, 12288])
@pytest.mark.parametrize("per_chunk", [1, 2, 8, 64])
def test_expected_chunk_crcs_equal_the_crc_of_the_chunk(page_bytes: int, per_chunk: int) -> None:
    raw, crcs = _pages(2, 37, page_bytes)
    linear = np.array([0, 3, 4, 5, 20, 36, 37, 40, 41, 73])  # any order of pages, a short last chunk
    heads, pages = np.divmod(linear, 37)
    rows = np.ascontiguousarray(raw[linear])
    want = expected_chunk_crcs(crcs[heads, pages], page_seeds(PID, 3, heads, pages), page_bytes, per_chunk)
    got = [chunk_crc(rows[c : c + per_chunk]) for c in range(0, len(linear), per_chunk)]
    assert want.tolist() == got


@pytest.mark.parametrize("threads", [1, 3])
def test_intact_pages_pass_and_any_bad_page_is_named(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_io, "VERIFY_CHUNK_BYTES", 4 * 4096)  # chunks of 4 pages: many chunks
    raw, crcs = _pages(3, 30, 4096)
    linear = np.arange(2, 85, dtype=np.int64)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    out = np.ascontiguousarray(raw[linear])
    with monkeypatch.context() as m:  # intact chunks pass on their chunk CRC: no page-by-page pass
        m.setattr(page_io, "page_crc", lambda *a: pytest.fail("an intact chunk was re-checked page by page"))
        verify_pages(PID, 3, 30, linear, out, crcs, pool, threads)
    for victim, other in ((0, None), (13, None), (82, None), (40, 41), (7, 70)):
        bad = out.copy()
        if other is None:
            bad[victim, 1000] ^= 0x01  # one flipped bit
        else:  # two pages swapped: each is intact, but not the page asked for
            bad[[victim, other]] = bad[[other, victim]]
        h, p = divmod(int(linear[victim]), 30)
        with pytest.raises(CorruptData, match=f"layer 3 head {h} page {p} failed its checksum"):
            verify_pages(PID, 3, 30, linear, bad, crcs, pool, threads)
    with pytest.raises(CorruptData, match="layer 4 head 0 page 2 "):  # right bytes, another layer's identity
        verify_pages(PID, 4, 30, linear, out, crcs, pool, threads)
    if pool is not None:
        pool.shutdown()


def test_first_bad_page_is_reported_when_several_chunks_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_io, "VERIFY_CHUNK_BYTES", 2 * 4096)
    raw, crcs = _pages(1, 20, 4096)
    linear = np.arange(20, dtype=np.int64)
    out = raw.copy()
    out[[5, 11, 17], 0] ^= 0xFF
    with pytest.raises(CorruptData, match="head 0 page 5 failed"):
        verify_pages(PID, 3, 20, linear, out, crcs, ThreadPoolExecutor(2), 2)
