"""Layer-ahead prefetch: the same greedy output with it on, SSD reads moved off the real fetches, a corrupt
page never served through it, hooks gone after a generation, and the speculative query exact where it must be.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_helpers import (
    LAYERS,
    PAGE,
    gather_rows,
    layer_path,
    open_store,
    page_tokens,
    stored_document,
    write_prefix,
)

from store.config import StoreConfig
from store.errors import CorruptData
from store.kvstore import KVStore
from workers.attention import PREFIX_KWARG
from workers.engine import Worker
from workers.methods.registry import METHODS
from workers.model import LoadedModel, load_model
from workers.offload import HostTier, OffloadConfig, PageFetcher
from workers.requests import DecodeConfig, GenerationStats, SamplingParams
from workers.speculate import open_lookahead, query_parts

DOC = " ".join(f"item {i} is {chr(97 + i % 26)}{(i * 7919) % 1000}." for i in range(60)) + " The code is 4711."
QUERY = " What is the code? And item 17?"
NEW_TOKENS = 6
SPARSE = sorted(m for m in METHODS if m != "full")
MODES = ("speculative", "same_pages")


def _tiers(lm: LoadedModel, prefetch: str, host_pages: int = 200, **kw) -> OffloadConfig:
    """Cold SSD: a small GPU cache and host tier (the prefix has 256 pages), nothing preloaded."""
    lay = lm.layout
    return OffloadConfig(gpu_cache_bytes=48 * lay.n_layers * lay.page_payload_bytes,
                         host_cache_bytes=host_pages * lay.page_bytes, io_threads=2, warm_host_fraction=0,
                         prefetch=prefetch, **kw)


def _run(worker: Worker, pid: str, method: str, budget: float | None = 0.1) -> GenerationStats:
    st = GenerationStats()
    list(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method=method,
                         decode=DecodeConfig(budget=budget), stats=st, raw=True))
    return st


def _hooks(lm: LoadedModel) -> int:
    return sum(len(layer._forward_pre_hooks) for layer in lm.model.model.layers)


@pytest.fixture(scope="module")
def stored(lm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KVStore, str]]:
    with stored_document(lm, tmp_path_factory.mktemp("pf"), DOC) as s:
        yield s


@pytest.fixture(scope="module")
def without(stored, lm):
    """Memoized prefetch-off runs per method."""
    runs: dict[str, GenerationStats] = {}

    def run(method: str) -> GenerationStats:
        if method not in runs:
            runs[method] = _run(Worker(stored[0], lm, progress=False, offload=_tiers(lm, "off")), stored[1], method)
        return runs[method]

    return run


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", SPARSE)
def test_greedy_output_equals_prefetch_off(stored, without, lm, method: str, mode: str) -> None:
    store, pid = stored
    ref = without(method)
    on = _run(Worker(store, lm, progress=False, offload=_tiers(lm, mode)), pid, method)
    assert on.token_ids == ref.token_ids and len(on.token_ids) >= 1
    assert on.prefix_tokens_per_step == ref.prefix_tokens_per_step
    x = on.extra
    assert x["offload_pages_requested"] == x["offload_gpu_hits"] + x["offload_host_pages"] + x["offload_ssd_pages"]
    assert x["offload_pages_requested"] == ref.extra["offload_pages_requested"]  # the same pages were asked for
    assert x["offload_prefetch_jobs"] > 0 and x["offload_prefetch_errors"] == 0
    assert x["offload_prefetch_useful"] <= x["offload_prefetch_pages"]
    # every prediction was scored against the next layer's real selection of the same forward
    assert x["offload_prefetch_selected_pages"] > 0 and 0 < x["offload_prefetch_recall"] <= 1
    assert "offload_prefetch_jobs" not in ref.extra
    assert _hooks(lm) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["quest", "topk", "doublep+phi"])
def test_prefetch_moves_ssd_reads_off_the_fetches(stored, lm, method: str, mode: str) -> None:
    """With a host tier that never evicts (still cold: nothing preloaded) each page is read from SSD once,
    so every useful prefetched page is exactly one SSD read the real fetches no longer make."""
    store, pid = stored
    lay = lm.layout
    big = lay.n_layers * lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)  # the whole prefix
    off = _run(Worker(store, lm, progress=False, offload=_tiers(lm, "off", big)), pid, method).extra
    x = _run(Worker(store, lm, progress=False, offload=_tiers(lm, mode, big)), pid, method).extra
    assert x["offload_prefetch_useful"] > 0
    assert x["offload_ssd_pages"] + x["offload_prefetch_useful"] == off["offload_ssd_pages"]
    assert x["offload_prefetch_moved_fraction"] == pytest.approx(
        x["offload_prefetch_useful"] / off["offload_ssd_pages"])


def _zero_layer0(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model with layer 0 adding nothing to the residual stream (o_proj, down_proj = 0): identity."""
    lm = load_model(str(tiny_model_dir), page_size=16, progress=False)
    layer0 = lm.model.model.layers[0]
    with torch.no_grad():
        layer0.self_attn.o_proj.weight.zero_()
        layer0.mlp.down_proj.weight.zero_()
    return lm


@pytest.mark.parametrize("method", ["quest", "topk", "doublep"])
def test_speculation_is_exact_when_layer0_is_identity(tiny_model_dir: Path, tmp_path: Path, method: str) -> None:
    """Layer 1's query from layer 0's input is then its real query: the prediction matches page for page."""
    lm = _zero_layer0(tiny_model_dir)
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=16))
    pid = Worker(store, lm, progress=False, offload=None).prefill(DOC).prefix_id
    x = _run(Worker(store, lm, progress=False, offload=_tiers(lm, "speculative")), pid, method).extra
    assert x["offload_prefetch_selected_pages"] > 0
    assert x["offload_prefetch_matched_pages"] == x["offload_prefetch_predicted_pages"] == x[
        "offload_prefetch_selected_pages"]
    store.close()


def test_speculative_query_equals_the_layers_own_query(lm: LoadedModel) -> None:
    """``QueryParts.query`` of layer 1 on a hidden state = the query layer 1's attention computes from it."""
    model = lm.model
    parts = query_parts(model)
    assert parts is not None and len(parts) == lm.layout.n_layers
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, model.config.hidden_size, generator=g)
    pos = torch.arange(100, 105)[None]
    cos, sin = model.model.rotary_emb(hidden, position_ids=pos)
    seen = {}

    class Record:
        def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            seen[layer] = (q.clone(), scale)
            b, h, l, d = q.shape
            return torch.zeros(b, h, l, d), torch.full((b, h, l), float("-inf"))

    with torch.inference_mode():
        model.model.layers[1](hidden, position_embeddings=(cos, sin), position_ids=pos, **{PREFIX_KWARG: Record()})
        q = parts[1].query(hidden, cos, sin)
        other = parts[0].query(hidden, cos, sin)
    assert torch.equal(q, seen[1][0]) and parts[1].scaling == seen[1][1]
    assert not torch.allclose(other, seen[1][0])  # the check can fail: layer 0's projection differs


def test_unknown_models_get_no_speculation(stored, lm, monkeypatch: pytest.MonkeyPatch) -> None:
    assert query_parts(torch.nn.Linear(2, 2)) is None
    assert open_lookahead(lm.model, object(), _tiers(lm, "speculative")) is None  # not a sparse method
    store, pid = stored
    monkeypatch.setattr(lm.model.config, "model_type", "not-a-llama")
    assert query_parts(lm.model) is None
    spec = _run(Worker(store, lm, progress=False, offload=_tiers(lm, "speculative")), pid, "quest")
    assert "offload_prefetch_jobs" not in spec.extra  # no speculation, no prefetch
    same = _run(Worker(store, lm, progress=False, offload=_tiers(lm, "same_pages")), pid, "quest")
    assert same.extra["offload_prefetch_jobs"] > 0  # needs nothing from the model
    assert same.token_ids == spec.token_ids


def test_hooks_live_exactly_as_long_as_the_generation(stored, lm) -> None:
    store, pid = stored
    w = Worker(store, lm, progress=False, offload=_tiers(lm, "speculative"))
    gen = w.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method="quest", raw=True)
    assert _hooks(lm) == 0  # nothing installed until the stream starts
    next(gen)
    assert _hooks(lm) == lm.layout.n_layers
    gen.close()  # abandoned by the client
    assert _hooks(lm) == 0


# -- fail closed -----------------------------------------------------------------------------------
def test_corrupt_page_fails_the_request_with_prefetch(lm, tmp_path: Path) -> None:
    store = KVStore(StoreConfig(home=tmp_path / "home", page_size=lm.layout.page_size))
    w = Worker(store, lm, progress=False, offload=_tiers(lm, "speculative"))
    pid = w.prefill(DOC).prefix_id
    path = store.prefix_dir(pid) / store.manifest(pid).files[1].name
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # layer 1, head 0, page 0: a sink page layer 0's prefetch asks for at the first step
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        _run(w, pid, "quest")
    assert _hooks(lm) == 0  # removed after the error too
    assert store.leases(pid) == []
    store.close()


@pytest.fixture()
def small_store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "home")
    yield s
    s.close()


def _fetcher(store: KVStore, m, host: HostTier, **kw) -> PageFetcher:
    cfg = OffloadConfig(gpu_cache_bytes=16 * LAYERS * m.layout.page_payload_bytes, io_threads=2, **kw)
    return PageFetcher(store, m, "cpu", cfg, host)


def _host(m, pages: int = 64) -> HostTier:
    return HostTier(page_bytes=m.layout.page_bytes, budget_bytes=pages * m.layout.page_bytes)


def test_prefetched_pages_are_served_from_the_host_tier(small_store: KVStore) -> None:
    m, kv = write_prefix(small_store, PAGE * 12)
    pages = torch.tensor([[0, 3, 4, 9], [1, 2, 11, -1]])
    with _fetcher(small_store, m, _host(m)) as f:
        assert f.prefetch(1, pages) == 7
        assert f.prefetch(1, pages) == 0  # queued or done already: not read twice
        f.wait_prefetch()
        pf = f.stats.prefetch
        assert pf is not None and pf.pages == 7 and pf.jobs == 1
        r = f.fetch(1, pages)
        assert f.stats.total.ssd_pages == 0 and f.stats.total.host_pages == 7 and pf.useful == 7
        tok, ok = page_tokens(torch.tensor([[0, 3, 4, 9], [1, 2, 11, 11]]), m.n_tokens)
        got, want = gather_rows(r.k, r.token_rows(tok)), gather_rows(kv[1][0], tok)
        assert torch.equal(got[ok], want[ok])
        assert f.prefetch(1, pages) == 0  # now in the GPU cache


def test_corrupt_page_is_never_inserted_by_a_prefetch(small_store: KVStore) -> None:
    m, _ = write_prefix(small_store, PAGE * 12)
    path = layer_path(small_store, m, 2)
    with open(path, "r+b") as fh:  # head 1, page 5 of layer 2
        fh.seek((12 + 5) * m.layout.page_bytes + 7)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x01]))
    host = _host(m)
    with _fetcher(small_store, m, host) as f:
        f.prefetch(2, torch.tensor([[0, 5], [4, 5]]))
        f.wait_prefetch()
        assert f.stats.prefetch is not None and f.stats.prefetch.errors == 1 and f.stats.prefetch.pages == 0
        assert host.used_bytes == 0  # nothing of the failed read entered the tier, good pages included
        with pytest.raises(CorruptData, match="layer 2 head 1 page 5"):
            f.fetch(2, torch.tensor([[0, 5], [4, 5]]))
        f.fetch(2, torch.tensor([[0, 5], [4, -1]]))  # the good pages still fetch
        assert f.stats.total.ssd_pages == 3


class _SlowReader:
    """Delays the prefetcher's reads so a real fetch arrives while one is running."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay, self.started = inner, delay, threading.Event()

    def read(self, *args):
        self.started.set()
        time.sleep(self.delay)
        return self.inner.read(*args)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("seed", range(4))
def test_fetch_waits_for_a_running_prefetch_no_double_read(small_store: KVStore, seed: int) -> None:
    m, kv = write_prefix(small_store, PAGE * 12)
    host = _host(m)
    g = torch.Generator().manual_seed(seed)
    with _fetcher(small_store, m, host) as f:
        f.enable_prefetch()
        pf = f._prefetcher
        assert pf is not None
        pf.reader = slow = _SlowReader(pf.reader, 0.05)
        pages = torch.stack([torch.randperm(12, generator=g)[:5] for _ in range(2)])
        asked = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(2)])
        n = f.prefetch(0, pages)
        assert slow.started.wait(5)
        r = f.fetch(0, asked)  # overlaps the running read: waits for it, reads only the rest
        c = f.stats.prefetch
        assert c is not None
        both = len(set(f._page_keys(pages)[0].tolist()) & set(f._page_keys(asked)[0].tolist()))
        if both:
            assert c.waits == 1
        f.wait_prefetch()
        assert c.pages == n == 10
        assert c.useful == both and f.stats.total.ssd_pages == 12 - both
        assert host.lru.used == 10 + 12 - both  # each page inserted once
        tok, ok = page_tokens(asked, m.n_tokens)
        assert torch.equal(gather_rows(r.v, r.token_rows(tok))[ok], gather_rows(kv[0][1], tok)[ok])


def test_queued_prefetch_is_cancelled_by_the_fetch(small_store: KVStore) -> None:
    m, _ = write_prefix(small_store, PAGE * 12)
    with _fetcher(small_store, m, _host(m)) as f:
        f.enable_prefetch()
        pf = f._prefetcher
        assert pf is not None
        pf.reader = slow = _SlowReader(pf.reader, 0.2)
        assert f.prefetch(0, torch.tensor([[1], [1]])) == 2  # running (slow)
        assert f.prefetch(1, torch.tensor([[2], [2]])) == 2  # queued behind it
        assert f.prefetch(2, torch.tensor([[3], [3]])) == 0  # queue full: dropped
        assert slow.started.wait(5)
        f.fetch(1, torch.tensor([[2], [2]]))  # layer 1's job has not started: cancelled, read here
        c = f.stats.prefetch
        assert c is not None and c.dropped == 2 and f.stats.total.ssd_pages == 2
        f.wait_prefetch()
        assert c.pages == 2  # only layer 0's job ran


def test_no_host_tier_means_no_prefetch(small_store: KVStore) -> None:
    m, _ = write_prefix(small_store, PAGE * 4)
    cfg = OffloadConfig(gpu_cache_bytes=16 * LAYERS * m.layout.page_payload_bytes)
    with PageFetcher(small_store, m, "cpu", cfg) as f:
        assert f.enable_prefetch() is None and f.prefetch(0, torch.tensor([[0], [1]])) == 0
        assert "offload_prefetch_jobs" not in f.stats.as_dict()
