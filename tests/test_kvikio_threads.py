"""kvikio's I/O thread pool is raised to the reader's depth: its default (one thread) runs every page read
of a step one after another. A stand-in ``kvikio`` module records the pool size (kvikio needs CUDA here;
tests/test_offload_cuda.py checks the real one)."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator

import pytest

from store.page_io import ensure_kvikio_threads, open_page_reader


class NewDefaults:
    """``kvikio.defaults`` from 25.x on: ``get(name)`` / ``set(name, value)``."""

    def __init__(self, threads: int = 1):
        self.threads, self.resets = threads, 0

    def get(self, name: str) -> int:
        assert name == "num_threads"
        return self.threads

    def set(self, name: str, value: int) -> None:
        assert name == "num_threads"
        self.threads, self.resets = value, self.resets + 1


class OldDefaults:
    """``kvikio.defaults`` before 25.x: ``get_num_threads`` / ``num_threads_reset``."""

    def __init__(self, threads: int = 1):
        self.threads, self.resets = threads, 0

    def get_num_threads(self) -> int:
        return self.threads

    def num_threads_reset(self, value: int) -> None:
        self.threads, self.resets = value, self.resets + 1


@pytest.fixture(params=[NewDefaults, OldDefaults])
def fake_kvikio(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    mod = types.ModuleType("kvikio")
    mod.defaults = request.param()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    yield mod


def test_reader_raises_pool_to_depth(fake_kvikio: types.ModuleType) -> None:
    d = fake_kvikio.defaults  # type: ignore[attr-defined]
    r = open_page_reader("kvikio", cuda=True, depth=32)
    assert r.name == "kvikio"
    assert d.threads == 32 and d.resets == 1
    assert r.threads == 32  # type: ignore[attr-defined]


def test_reader_never_lowers_pool(fake_kvikio: types.ModuleType) -> None:
    d = fake_kvikio.defaults  # type: ignore[attr-defined]
    open_page_reader("kvikio", cuda=True, depth=64)
    open_page_reader("kvikio", cuda=True, depth=8)
    open_page_reader("kvikio", cuda=True, depth=64)
    assert d.threads == 64 and d.resets == 1  # one reset: a pool that is large enough is left alone


def test_pool_already_larger_is_kept(fake_kvikio: types.ModuleType) -> None:
    d = fake_kvikio.defaults  # type: ignore[attr-defined]
    d.threads = 128  # e.g. KVIKIO_NTHREADS set by the operator
    assert ensure_kvikio_threads(fake_kvikio, 32) == 128
    assert d.threads == 128 and d.resets == 0


def test_concurrent_readers_reset_once(fake_kvikio: types.ModuleType) -> None:
    d = fake_kvikio.defaults  # type: ignore[attr-defined]
    threads = [threading.Thread(target=open_page_reader, args=("kvikio",), kwargs={"cuda": True, "depth": 16})
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.threads == 16 and d.resets == 1
