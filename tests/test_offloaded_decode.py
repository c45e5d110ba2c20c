"""Decode through the tiered page fetch (the worker's default) against the resident path.

Every method must give the same greedy tokens whether each step fetches only its pages (GPU page
cache -> host tier -> SSD page files, with evictions forced by small tiers) or reads whole layers
once; the stats must show what the tiers moved; a corrupt page must fail the request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_helpers import stored_document

from store.errors import CorruptData
from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods.registry import METHODS, QUERY_TIME, compression_methods
from workers.offload import OffloadConfig
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

REPO = Path(__file__).resolve().parents[1]
DOC = " ".join(f"item {i} is {chr(97 + i % 26)}{(i * 7919) % 1000}." for i in range(60)) + " The code is 4711."
QUERY = " What is the code? And item 17?"
NEW_TOKENS = 6
SLOTS_PER_LAYER = 48
"""Small enough that steps evict each other's pages (a layer has ~90 pages), big enough for one row."""


def _tiers(lm, host_pages: int, **kw) -> OffloadConfig:
    lay = lm.layout
    return OffloadConfig(gpu_cache_bytes=SLOTS_PER_LAYER * lay.n_layers * lay.page_payload_bytes,
                         host_cache_bytes=host_pages * lay.page_bytes, io_threads=2, **kw)


def _run(worker: Worker, pid: str, method: str, budget: float | None) -> GenerationStats:
    st = GenerationStats()
    list(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method=method,
                         decode=DecodeConfig(budget=budget), stats=st, raw=True))
    return st


@pytest.fixture(scope="module")
def stored(lm, tmp_path_factory) -> Iterator[tuple[KVStore, str]]:
    with stored_document(lm, tmp_path_factory.mktemp("off"), DOC) as s:
        yield s


@pytest.fixture(scope="module")
def resident(stored, lm):
    """Memoized resident-path runs by (method, budget)."""
    w, runs = Worker(stored[0], lm, progress=False, offload=None), {}

    def run(method: str, budget: float | None) -> GenerationStats:
        if (method, budget) not in runs:
            runs[method, budget] = _run(w, stored[1], method, budget)
        return runs[method, budget]

    return run


FETCHING = sorted(set(METHODS) - QUERY_TIME - set(compression_methods()))
"""Methods that read the stored prefix per step (compressed caches read their own artifact: test_compressed.py)."""
"""Methods that fetch pages per step (a query-time cache reads the prefix once, through ``PrefixSource``)."""
CASES = [(m, b, 100) for m in FETCHING for b in (None, 0.2)] + [(m, 0.2, 0) for m in FETCHING]


@pytest.mark.parametrize(("method", "budget", "host_pages"), CASES,
                         ids=[f"{m}-{b}-{'host' if h else 'ssd-only'}" for m, b, h in CASES])
def test_offloaded_greedy_equals_resident(stored, resident, lm, method: str, budget: float | None,
                                          host_pages: int) -> None:
    store, pid = stored
    ref = resident(method, budget)
    off = _run(Worker(store, lm, progress=False, offload=_tiers(lm, host_pages)), pid, method, budget)
    assert off.token_ids == ref.token_ids and len(off.token_ids) >= 1
    assert off.prefix_tokens_per_step == ref.prefix_tokens_per_step
    if method == "full":  # the fetch-everything baseline reads whole layers
        assert off.bytes_fetched == off.bytes_full
        return
    x = off.extra
    lay = lm.layout
    # every page a step asked for came from exactly one tier
    assert x["offload_pages_requested"] == x["offload_gpu_hits"] + x["offload_host_pages"] + x["offload_ssd_pages"]
    assert x["offload_steps"] == off.steps
    once = x.get("once_bytes_selector", 0) + x["bytes_summaries"]  # every one-time read, summaries included
    index = x.get("index_bytes", 0)  # resident summaries selection scanned per step (Double-P's centroids)
    assert off.bytes_fetched == x["offload_pages_requested"] * lay.page_payload_bytes + once + index
    assert x["offload_ssd_pages"] > 0  # cold start
    if host_pages == 0:
        assert x["offload_host_pages"] == 0
    if budget is not None:  # the small cache really was exercised: evictions, or rows over it (a one-off pool)
        assert x["offload_gpu_evictions"] > 0 or x["offload_overflow_fetches"] > 0
    if x["offload_overflow_fetches"] == 0:
        assert x["offload_gpu_hits"] > 0  # step-to-step reuse
    assert x["bytes_summaries"] >= 0


def test_sparse_offloaded_reads_a_fraction(stored, lm) -> None:
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, 100))
    st = _run(w, pid, "quest", 0.05)
    assert st.steps >= 2 and st.bytes_full > 0
    assert st.bytes_fetched < 0.5 * st.bytes_full
    # pages bound the exact tokens from above: a page fetch never moves less than the tokens attended
    token_bytes = sum(st.prefix_tokens_per_step) * lm.layout.token_kv_bytes()
    assert st.bytes_fetched >= token_bytes


def test_host_tier_is_shared_across_generations(stored, lm) -> None:
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, 1000, warm_host_fraction=0))
    first = _run(w, pid, "quest", 0.2)
    again = _run(w, pid, "quest", 0.2)
    assert again.token_ids == first.token_ids
    assert first.extra["offload_ssd_pages"] > 0
    assert again.extra["offload_ssd_pages"] == 0 and again.extra["offload_host_pages"] > 0


def test_query_time_cache_reads_a_hot_prefix_from_the_host_tier(stored, lm, monkeypatch) -> None:
    """SnapKV's query step reads whole layers through the tiers: a second question over the same prefix comes
    from the host tier (no page-file read), with the tokens of the resident path."""
    store, pid = stored
    lay, n = lm.layout, store.manifest(pid).n_tokens
    decode = DecodeConfig(budget_tokens=24)

    def ask(w: Worker) -> GenerationStats:
        st = GenerationStats()
        list(w.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method="snapkv", decode=decode,
                        stats=st, raw=True))
        return st

    ref = ask(Worker(store, lm, progress=False, offload=None))
    store_reads: list[int] = []
    read_layer = store.read_layer
    monkeypatch.setattr(store, "read_layer", lambda *a, **kw: store_reads.append(1) or read_layer(*a, **kw))
    layer_pages = lay.n_layers * lay.n_kv_heads * lay.n_pages(n)
    w = Worker(store, lm, progress=False, offload=_tiers(lm, layer_pages + 10, warm_host_fraction=0))
    first, again = ask(w), ask(w)
    assert first.token_ids == again.token_ids == ref.token_ids and len(ref.token_ids) >= 1
    assert first.extra["offload_ssd_pages"] == layer_pages  # every layer once, from the page files
    assert again.extra["offload_ssd_pages"] == 0 and again.extra["offload_host_pages"] == layer_pages
    assert store_reads == []  # never the store's own whole-layer read
    # the reads stay counted as before: the prefix once (by the query step), then the kept entries
    assert again.bytes_fetched == ref.bytes_fetched
    assert again.prefix_tokens_per_step == ref.prefix_tokens_per_step


@pytest.mark.parametrize("method", [m for m in FETCHING if m != "full"])
def test_device_planned_fetch_of_a_warm_prefix_equals_resident(stored, resident, lm, method: str) -> None:
    """A prefix that fits the host tier is warmed whole; steps are then fetched through the device-planned
    cache (its torch plan on the CPU), falling back to the fetcher for steps that do not fit one call."""
    store, pid = stored
    ref = resident(method, 0.1)
    lay = lm.layout
    # Room for one call of every page of a head: each step fits the device-planned cache.
    pages = lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)
    tiers = OffloadConfig(gpu_cache_bytes=2 * pages * lay.n_layers * lay.page_payload_bytes,
                          host_cache_bytes=1000 * lay.page_bytes, device_plan="on", warm_in_background=False)
    off = _run(Worker(store, lm, progress=False, offload=tiers), pid, method, 0.1)
    assert off.token_ids == ref.token_ids
    x = off.extra
    assert x["offload_ssd_pages"] == 0  # warmed at open: every step is served from the GPU cache or host tier
    assert x["offload_pages_requested"] == x["offload_gpu_hits"] + x["offload_host_pages"]
    if method == "doublep":  # its centroid rows live in the fetcher's cache: the fetcher serves it
        assert x["offload_device_plan_pages"] == 0
    else:  # every decode step (one query row) went through the device-planned cache
        assert x["offload_device_plan_fetches"] >= (off.steps - 1) * lay.n_layers
        assert x["offload_device_plan_pages"] > 0 and x["offload_gpu_hits"] > 0


def test_corrupt_page_fails_the_request(lm, tmp_path) -> None:
    from store.config import StoreConfig

    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=lm.layout.page_size))
    w = Worker(store, lm, progress=False, offload=_tiers(lm, 100))
    pid = w.prefill(DOC).prefix_id
    m = store.manifest(pid)
    path = store.prefix_dir(pid) / m.files[0].name
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # inside page 0 of head 0: a sink page every step fetches
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        _run(w, pid, "quest", 0.2)
    assert store.leases(pid) == []  # the failed request released its lease
    store.close()


@pytest.mark.slow
def test_cli_generate_stats_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = {**os.environ, "KVSTASH_HOME": str(tmp_path / "home"), "KVSTASH_MODEL": str(tiny_model_dir)}

    def cli(*args: str, stdin: str | None = None) -> dict:
        r = subprocess.run([sys.executable, "-m", "client.cli", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, input=stdin, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    pid = cli("prefill", "-", "--json", stdin=DOC)["prefix_id"]
    out = cli("generate", "--prefix", pid, "What is the code?", "--method", "quest", "--budget", "0.1",
              "--max-new-tokens", "4", "--stats", "--json")
    st = out["stats"]
    assert st["steps"] >= 1 and 0 < st["bytes_fetched"] < st["bytes_full"]
    assert st["offload_pages_requested"] > 0
    assert {"offload_bytes_gpu_hit", "offload_bytes_host", "offload_bytes_ssd", "offload_hit_rate"} <= set(st)
    assert min(st["offload_select_s"], st["offload_fetch_s"], st["offload_attend_s"]) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("warm", [False, True], ids=["fetcher", "device-planned"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", [m for m in FETCHING if m != "full"])
def test_cuda_offloaded_greedy_equals_resident(tiny_model_dir: Path, tmp_path: Path, method: str, dtype: str,
                                               warm: bool) -> None:
    """On the GPU: pinned host tier, Triton gather from mapped host memory, Triton sparse kernel; warm:
    the whole prefix in the host tier and decode steps through the device-planned cache (Triton plan)."""
    from store.config import StoreConfig
    from workers.model import load_model

    lm = load_model(str(tiny_model_dir), device="cuda", dtype=dtype, page_size=16, progress=False)
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16))
    pid = Worker(store, lm, progress=False, offload=None).prefill(DOC).prefix_id
    ref = _run(Worker(store, lm, progress=False, offload=None), pid, method, 0.2)
    lay = lm.layout
    pages = lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)
    tiers = (OffloadConfig(gpu_cache_bytes=2 * pages * lay.n_layers * lay.page_payload_bytes,
                           host_cache_bytes=1000 * lay.page_bytes, warm_in_background=False) if warm
             else _tiers(lm, 100))
    off = _run(Worker(store, lm, progress=False, offload=tiers), pid, method, 0.2)
    assert off.token_ids == ref.token_ids and off.extra["offload_pages_requested"] > 0
    if warm and method != "doublep":
        assert off.extra["offload_device_plan_pages"] > 0 and off.extra["offload_ssd_pages"] == 0
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_query_time_cache_reads_a_hot_prefix_from_the_host_tier(tiny_model_dir: Path, tmp_path: Path,
                                                                    dtype: str) -> None:
    """On the GPU: SnapKV's whole-layer reads through the pinned host tier (Triton gather into a one-off pool)
    give the resident path's tokens, and a second question is served by the host tier."""
    from store.config import StoreConfig
    from workers.model import load_model

    lm = load_model(str(tiny_model_dir), device="cuda", dtype=dtype, page_size=16, progress=False)
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16))
    resident = Worker(store, lm, progress=False, offload=None)
    pid = resident.prefill(DOC).prefix_id
    lay = lm.layout
    layer_pages = lay.n_layers * lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)

    def ask(w: Worker) -> GenerationStats:
        st = GenerationStats()
        list(w.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method="snapkv",
                        decode=DecodeConfig(budget_tokens=24), stats=st, raw=True))
        return st

    w = Worker(store, lm, progress=False, offload=_tiers(lm, layer_pages + 10, warm_host_fraction=0))
    ref, first, again = ask(resident), ask(w), ask(w)
    assert first.token_ids == again.token_ids == ref.token_ids
    assert again.extra["offload_ssd_pages"] == 0 and again.extra["offload_host_pages"] == layer_pages
    store.close()


def test_full_reads_whole_layers_through_the_tiers(stored, resident, lm) -> None:
    """``full`` reads every layer at open through the worker's tiers: the first question reads each page from the
    page files (and fills the host tier), the next one over the same prefix reads them all from the host tier;
    tokens and reads are the resident path's."""
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, 10_000))
    lay = lm.layout
    pages = lay.n_layers * lay.n_kv_heads * -(-store.manifest(pid).n_tokens // lay.page_size)
    first, second = _run(w, pid, "full", None), _run(w, pid, "full", None)
    for st in (first, second):
        assert st.token_ids == resident("full", None).token_ids
        assert st.bytes_fetched == st.bytes_full
    assert (first.extra["offload_ssd_pages"], first.extra["offload_host_pages"]) == (pages, 0)
    assert (second.extra["offload_ssd_pages"], second.extra["offload_host_pages"]) == (0, pages)
