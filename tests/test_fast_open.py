"""Fast open: a generation over a cold prefix decodes while the host tier warms in the background, then
switches to the device-planned cache, with the same greedy tokens as over a warm prefix; closing it
mid-warm stops the warm-up; a corrupt page found by the warm-up fails the generation; the summaries
of a hot prefix come from a bounded host-memory cache."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from offload_helpers import LAYERS, PAGE, layer_path, open_store, stored_document, write_prefix

from store.errors import CorruptData
from store.kvstore import KVStore
from workers.engine import Worker
from workers.offload import HostTier, OffloadConfig, PageFetcher
from workers.offload.fast_path import FastOpen
from workers.offload.summaries import SummaryCache
from workers.offload.warmup import HostWarmup
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOC = " ".join(f"item {i} is {chr(97 + i % 26)}{(i * 7919) % 1000}." for i in range(60)) + " The code is 4711."
QUERY = " What is the code? And item 17?"


def _tiers(lm, store: KVStore, pid: str, **kw) -> OffloadConfig:
    """Host tier holding the whole prefix; GPU cache with room for one call of every page of a head."""
    lay = lm.layout
    pages = lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)
    kw = {"device_plan": "on", **kw}
    return OffloadConfig(gpu_cache_bytes=2 * pages * lay.n_layers * lay.page_payload_bytes,
                         host_cache_bytes=1000 * lay.page_bytes, io_depth=4, io_threads=2,
                         warm_chunk_bytes=lay.page_bytes, **kw)


def _run(worker: Worker, pid: str, *, method: str = "quest", new: int = 8,
         turn=contextlib.nullcontext) -> GenerationStats:  # noqa: ANN001 - a StepTurn
    st = GenerationStats()
    worker.engine.turn = turn  # held around each decode step
    list(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=new), method=method,
                         decode=DecodeConfig(budget=0.2), stats=st, raw=True))
    return st


@pytest.fixture(scope="module")
def stored(lm, tmp_path_factory) -> Iterator[tuple[KVStore, str]]:
    with stored_document(lm, tmp_path_factory.mktemp("fast"), DOC) as s:
        yield s


@pytest.fixture()
def warmups(monkeypatch: pytest.MonkeyPatch) -> list[HostWarmup]:
    """Every background warm-up started, in order."""
    started: list[HostWarmup] = []
    real = HostWarmup.start

    def start(self: HostWarmup) -> HostWarmup:
        started.append(self)
        return real(self)

    monkeypatch.setattr(HostWarmup, "start", start)
    return started


def _slow_chunks(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None, delay_s: float = 0.0) -> None:
    """Warm-up chunks wait for ``gate`` (checking for a stop) and then ``delay_s``."""
    real = HostWarmup._chunk

    def chunk(self: HostWarmup, *args) -> None:  # noqa: ANN002
        while gate is not None and not gate.wait(0.01):
            if self._stop.is_set():
                return
        time.sleep(delay_s)
        real(self, *args)

    monkeypatch.setattr(HostWarmup, "_chunk", chunk)


@pytest.mark.parametrize("method", ["quest", "topk"])
def test_cold_open_decodes_at_once_then_switches_with_warm_tokens(stored, lm, warmups, method: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store, pid = stored
    warm = _run(Worker(store, lm, progress=False, offload=_tiers(lm, store, pid, warm_in_background=False)),
                pid, method=method)
    assert warm.extra["offload_ssd_pages"] == 0 and warm.extra.get("offload_device_plan_fetches", 0) > 0
    resident = _run(Worker(store, lm, progress=False, offload=None), pid, method=method)

    gate = threading.Event()
    _slow_chunks(monkeypatch, gate)
    steps = itertools.count()

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        if next(steps) == 2:  # two steps decoded over the cold prefix; now let the warm-up run to its end
            gate.set()
            assert warmups[0]._thread is not None
            warmups[0]._thread.join(timeout=60)
        yield

    cold = _run(Worker(store, lm, progress=False, offload=_tiers(lm, store, pid)), pid, method=method, turn=turn)
    assert len(warmups) == 1 and warmups[0].done and warmups[0].complete
    assert cold.token_ids == warm.token_ids == resident.token_ids and len(cold.token_ids) >= 4
    x = cold.extra
    assert x["offload_ssd_pages"] > 0  # the first steps read their pages from SSD while the tier was cold
    assert x["offload_device_plan_fetches"] >= (cold.steps - 3) * lm.layout.n_layers  # then the switch
    assert x["offload_pages_requested"] == x["offload_gpu_hits"] + x["offload_host_pages"] + x["offload_ssd_pages"]


def test_closing_a_generation_mid_warm_stops_the_warm_up(endless_lm, tmp_path: Path, warmups,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with stored_document(endless_lm, tmp_path / "h", DOC) as (store, pid):
        w = Worker(store, endless_lm, progress=False, offload=_tiers(endless_lm, store, pid))
        baseline = set(threading.enumerate())
        _slow_chunks(monkeypatch, delay_s=0.02)  # ~0.02 s per page: seconds of warm-up
        gen = cast(Generator[str, None, None], w.generate(pid, QUERY, SamplingParams(max_new_tokens=200),
                                                          method="quest", decode=DecodeConfig(budget=0.2), raw=True))
        next(gen)
        assert warmups[0].running
        gen.close()
        assert not warmups[0].running and not warmups[0].done
        assert set(threading.enumerate()) == baseline  # warm-up and I/O pool threads all joined
        host = w.host_tier()
        assert host is not None and int(host.lru.holds.sum()) == 0
        assert store.leases(pid) == []


def test_corrupt_page_found_by_the_warm_up_fails_the_generation(tmp_path: Path) -> None:
    store = open_store(tmp_path / "home")
    m, _ = write_prefix(store, PAGE * 12)
    lay = m.layout
    path = layer_path(store, m, 2)
    with open(path, "r+b") as f:
        f.seek(lay.page_offset(1, 9, PAGE * 12) + 3)
        f.write(b"\x7f")
    cfg = OffloadConfig(gpu_cache_bytes=64 * LAYERS * lay.page_payload_bytes, host_cache_bytes=1000 * lay.page_bytes,
                        device_plan="on", io_threads=2, io_depth=2)
    tier = HostTier(page_bytes=lay.page_bytes, budget_bytes=cfg.host_cache_bytes)
    with PageFetcher(store, m, "cpu", cfg, tier) as fetcher:
        fast = FastOpen(fetcher, cfg)
        assert fast.device_cache is None and fetcher.warmup is not None
        fetcher.warmup._thread.join(timeout=30)  # type: ignore[union-attr]
        with pytest.raises(CorruptData, match="layer 2 head 1 page 9 failed its checksum"):
            fast.poll()
        assert fast.poll() is None  # reported once; the fetcher still serves (and checks) every page
    store.close()


def test_an_already_warm_prefix_opens_the_device_cache_at_once(stored, lm) -> None:
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, store, pid))
    _run(w, pid)
    host = w.host_tier()
    assert host is not None and host.used_bytes > 0
    st = _run(w, pid)  # the first generation's warm-up left the whole prefix in the tier
    assert st.extra["offload_ssd_pages"] == 0
    assert st.extra["offload_device_plan_fetches"] >= st.steps * lm.layout.n_layers


def test_summaries_of_a_hot_prefix_are_read_once(stored, lm, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, store, pid))
    reads: list[str] = []
    real = KVStore.artifact_read

    def artifact_read(self: KVStore, prefix_id: str, name: str, **k: object) -> object:
        reads.append(name)  # every artifact read starts here (``KVStore.artifact`` and streamed summaries)
        return real(self, prefix_id, name, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(KVStore, "artifact_read", artifact_read)
    first = _run(w, pid)
    assert sorted(reads) == ["bounds", "page_crc"] and w.summaries.misses == 2
    again = _run(w, pid)
    assert len(reads) == 2 and w.summaries.hits == 2  # nothing read or parsed again
    assert again.token_ids == first.token_ids
    assert again.extra["bytes_summaries"] == first.extra["bytes_summaries"] > 0
    off = _run(Worker(store, lm, progress=False, offload=_tiers(lm, store, pid, summary_cache_bytes=0)), pid)
    assert off.token_ids == first.token_ids and len(reads) == 4  # a zero budget caches nothing


def test_summary_cache_is_bounded_lru_and_dropped_with_its_prefix(tmp_path: Path) -> None:
    store = open_store(tmp_path / "home")
    ms = [write_prefix(store, PAGE * 12, seed=s)[0] for s in range(3)]
    one = ms[0].layout.n_layers * ms[0].layout.n_kv_heads * 12 * 4  # bytes of one CRC table
    cache = SummaryCache(2 * one + 1)
    for m in ms:
        assert torch.equal(torch.from_numpy(cache.page_crcs(store, m).copy()),
                           torch.from_numpy(store.page_crcs(m.prefix_id).copy()))
    assert len(cache) == 2 and cache.used_bytes == 2 * one and cache.misses == 3
    cache.page_crcs(store, ms[2])
    cache.page_crcs(store, ms[1])
    assert cache.hits == 2
    cache.page_crcs(store, ms[0])  # evicted first (least recently used): a miss, which evicts ms[2]
    assert cache.misses == 4 and len(cache) == 2
    cache.page_crcs(store, ms[1])
    assert cache.hits == 3
    assert cache.drop(ms[1].prefix_id) == one and len(cache) == 1 and cache.used_bytes == one
    cache.page_crcs(store, ms[1])
    assert cache.misses == 5
    # an entry only serves the bytes its manifest's digest names: the same prefix id with other bytes misses
    art = [a for a in ms[0].artifacts if a.name == "page_crc"][0]
    other = type(ms[0])(**{**ms[0].__dict__, "artifacts": tuple(
        type(art)(name=a.name, size=a.size, blake2b="0" * 64) if a.name == "page_crc" else a
        for a in ms[0].artifacts)})
    cache.page_crcs(store, other)
    assert cache.misses == 6
    store.close()


def test_removing_a_prefix_drops_its_summaries(lm, tmp_path: Path) -> None:
    with stored_document(lm, tmp_path / "h", DOC) as (store, pid):
        w = Worker(store, lm, progress=False, offload=_tiers(lm, store, pid))
        _run(w, pid, new=2)
        assert len(w.summaries) == 2 and w.summaries.used_bytes > 0
        w.remove_prefix(pid)
        assert len(w.summaries) == 0 and w.summaries.used_bytes == 0 and not store.exists(pid)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cold_open_switches_to_the_device_planned_cache(tiny_model_dir: Path, tmp_path: Path, warmups,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU: pinned host tier filled by the background warm-up while Triton gathers read it, then
    the Triton-planned cache; tokens equal those over a prefix warmed before decoding."""
    from workers.model import load_model

    gpu_lm = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    with stored_document(gpu_lm, tmp_path / "h", DOC) as (store, pid):
        warm = _run(Worker(store, gpu_lm, progress=False,
                           offload=_tiers(gpu_lm, store, pid, device_plan="auto", warm_in_background=False)), pid)
        gate = threading.Event()
        _slow_chunks(monkeypatch, gate)
        steps = itertools.count()

        @contextlib.contextmanager
        def turn() -> Iterator[None]:
            if next(steps) == 2:
                gate.set()
                assert warmups[0]._thread is not None
                warmups[0]._thread.join(timeout=60)
            yield

        cold = _run(Worker(store, gpu_lm, progress=False, offload=_tiers(gpu_lm, store, pid, device_plan="auto")),
                    pid, turn=turn)
        assert cold.token_ids == warm.token_ids
        assert cold.extra["offload_ssd_pages"] > 0 and cold.extra["offload_device_plan_fetches"] > 0
