"""Concurrent SSD page reads (``PosixPageReader`` with a pool, ``OffloadConfig.io_depth``): the same bytes
as one sequential reader, up to ``io_depth`` reads really in flight, and failures still fail closed."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from offload_helpers import LAYERS, PAGE, layer_path, open_store, write_prefix

from store.errors import CorruptData
from store.kvstore import KVStore
from store.page_io import PageCheck, PosixPageReader, read_checked
from workers.offload import OffloadConfig, PageFetcher

N = PAGE * 40


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "home")
    yield s
    s.close()


class InFlight:
    """Wraps ``os.preadv`` and records the most calls running at once. Until ``expect`` have been in
    flight together, each call waits (up to a second) for the others: a reader that issues that many
    at once reaches it whatever the machine's load, one that issues fewer never does."""

    def __init__(self, expect: int):
        self.real, self.expect = os.preadv, expect
        self.now = self.most = self.calls = 0
        self.cond = threading.Condition()

    def __call__(self, fd: int, bufs: list, offset: int) -> int:
        with self.cond:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.most >= self.expect, timeout=1.0)
        try:
            return self.real(fd, bufs, offset)
        finally:
            with self.cond:
                self.now -= 1


def _random_linear(n_keys: int, k: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n_keys, size=k, replace=False))


@pytest.mark.parametrize("depth", [2, 8])
def test_concurrent_reads_equal_sequential_and_keep_depth_in_flight(store: KVStore, depth: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = write_prefix(store, N)
    lay = m.layout
    n_keys = lay.n_kv_heads * lay.n_pages(N)
    path, size = layer_path(store, m, 2), m.files[2].size
    crcs = store.page_crcs(m.prefix_id)[2]
    check = PageCheck(prefix_id=m.prefix_id, layer=2, n_pages=lay.n_pages(N), crcs=crcs)
    for seed in range(3):
        lin = _random_linear(n_keys, 50, seed)  # scattered pages: many short runs
        seq = np.zeros((lin.size, lay.page_bytes), dtype=np.uint8)
        read_checked(PosixPageReader(), path, size, lin, lay.page_bytes, seq, check)
        probe = InFlight(depth)
        monkeypatch.setattr(os, "preadv", probe)
        with ThreadPoolExecutor(depth) as pool:
            par = np.zeros_like(seq)
            report = read_checked(PosixPageReader(pool=pool, depth=depth), path, size, lin, lay.page_bytes, par,
                                  check, pool=pool, threads=depth)
        monkeypatch.setattr(os, "preadv", probe.real)
        assert np.array_equal(par, seq)
        assert report.calls == probe.calls > depth
        assert probe.most == depth  # io_depth reads in flight together, never more


def test_fetcher_reads_io_depth_pages_at_once(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m, kv = write_prefix(store, N)
    lay = m.layout
    cfg = OffloadConfig(gpu_cache_bytes=64 * LAYERS * lay.page_payload_bytes, io_depth=6, io_threads=2)
    probe = InFlight(6)
    monkeypatch.setattr(os, "preadv", probe)
    pages = torch.tensor([[0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33], [1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34]])
    with PageFetcher(store, m, "cpu", cfg, None) as f:
        r = f.fetch(1, pages)
        rows = r.token_rows((pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).reshape(2, -1))
    assert probe.most == 6
    k = r.k.gather(1, rows.unsqueeze(-1).expand(-1, -1, lay.head_dim))
    want = kv[1][0].view(lay.n_kv_heads, -1, PAGE, lay.head_dim)[torch.arange(2)[:, None], pages].flatten(1, 2)
    assert torch.equal(k, want)


def test_corrupt_page_is_named_under_concurrent_reads(store: KVStore) -> None:
    m, _ = write_prefix(store, N)
    lay = m.layout
    bad_head, bad_page = 1, 29
    path = layer_path(store, m, 0)
    with open(path, "r+b") as f:
        f.seek(lay.page_offset(bad_head, bad_page, N) + 7)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    cfg = OffloadConfig(gpu_cache_bytes=64 * LAYERS * lay.page_payload_bytes, io_depth=8, io_threads=4)
    pages = torch.arange(0, 40, 2).view(1, -1).expand(2, -1).clone()
    pages[1, -1] = bad_page
    with PageFetcher(store, m, "cpu", cfg, None) as f:
        f.fetch(1, pages)  # another layer: intact
        with pytest.raises(CorruptData, match=f"layer 0 head {bad_head} page {bad_page} failed its checksum"):
            f.fetch(0, pages)
