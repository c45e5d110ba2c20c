"""The CPU's in-place attention of a warm prefix (``HostPageView``) against the page fetcher's pool.

The view must give the rows of the stored K/V, hold the prefix's host-tier slots while open, and, through
the worker, give every sparse method bit-identical attention outputs and greedy tokens to the pool path,
with the same pages counted as read (from the host tier); a cold open switches to it once warm.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_helpers import HEADS, LAYERS, open_store, stored_document, write_prefix

from store.errors import InvalidInput
from store.kvstore import KVStore
from workers.engine import Worker
from workers.kernels import token_rows as token_rows_kernel
from workers.methods.sparse import SparsePrefixAttention
from workers.offload import HostTier, OffloadConfig, PageFetcher, PrefixHeld, host_view
from workers.offload.host_view import HostPageView
from workers.offload.warmup import HostWarmup
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

N_TOKENS = 200
"""A prefix of 13 pages per head, the last one partial."""
DOC = " ".join(f"item {i} is {chr(97 + i % 26)}{(i * 7919) % 1000}." for i in range(60)) + " The code is 4711."
QUERY = " What is the code? And item 17?"
NEW_TOKENS = 6
IN_PLACE = {"quest": True, "topk": True, "quest+phi": True, "doublep+phi": True, "doublep": True}
"""Method -> whether the view serves its steps: page steps (Quest, Top-K), token steps (Double-P) with extra entries
(its centroids), φ completion."""


@pytest.fixture()
def warm(tmp_path: Path) -> Iterator[tuple[PageFetcher, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """A fetcher over a prefix whole in its host tier, and the prefix's K/V per layer."""
    store = open_store(tmp_path)
    m, kv = write_prefix(store, N_TOKENS)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=2 * LAYERS * HEADS * 13 * m.layout.page_bytes)
    with PageFetcher(store, m, "cpu", OffloadConfig(gpu_cache_bytes=1 << 20), tier) as f:
        f.warm_host()
        yield f, kv
    store.close()


@pytest.fixture(params=["kernel", "numpy"])
def rows_path(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """``token_rows`` through the C++ token-rows kernel, and through numpy."""
    if request.param == "kernel" and not token_rows_kernel.cpu_kernel_available():
        pytest.skip("no C++ compiler: the token-rows kernel is not built")
    monkeypatch.setattr(host_view, "CPU_KERNEL", request.param == "kernel")
    return request.param


def test_rows_index_the_stored_kv(warm, rows_path: str) -> None:
    f, kv = warm
    view = HostPageView.from_fetcher(f)
    assert view is not None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, N_TOKENS, (2, HEADS, 30), generator=g)
    for layer, (k, v) in enumerate(kv):
        rows = view.token_rows(layer, tokens, torch.full((2, HEADS), 30), step=0)
        heads = torch.arange(HEADS).view(1, -1, 1)
        assert torch.equal(view.k[0][rows], k[heads, tokens]) and torch.equal(view.v[0][rows], v[heads, tokens])
        pages = torch.tensor([[3, 0, 12], [12, 5, -1]])
        first = view.page_rows(layer, pages, step=0)
        assert first[1, 2] == -1
        assert torch.equal(view.k[0][first[:, :2]], k[heads[0], pages[:, :2] * 16])
    view.close()


def test_reads_count_distinct_pages_from_the_host_tier(warm, rows_path: str) -> None:
    f, _ = warm
    view = HostPageView.from_fetcher(f)
    assert view is not None
    tokens = torch.tensor([[[0, 1, 17, 199, 150], [16, 31, 32, 0, 0]]])  # head 0: pages 0, 1, 12; head 1: 1, 2
    view.token_rows(0, tokens, torch.tensor([[4, 3]]), step=2)  # head 0's 150 is past its count: not read
    view.page_rows(1, torch.tensor([[4, 4 + 0 * 1, 7], [4, 8, -1]])[:, 1:], step=2)  # pages 4, 7 | 8
    st = f.stats.per_step[2]
    assert (st.pages, st.host_pages, st.gpu_hits, st.ssd_pages) == (5 + 3, 5 + 3, 0, 0)
    with pytest.raises(InvalidInput, match="token ids"):
        view.token_rows(0, torch.tensor([[[N_TOKENS], [0]]]), torch.tensor([[1, 1]]), step=2)
    with pytest.raises(InvalidInput, match="page ids"):
        view.page_rows(0, torch.tensor([[13], [0]]), step=2)
    view.close()


def test_the_view_holds_the_prefix_until_closed(warm) -> None:
    f, _ = warm
    view = HostPageView.from_fetcher(f)
    assert view is not None
    assert f.host is not None
    with pytest.raises(PrefixHeld):
        f.host.drop_prefix(f.prefix_id)
    view.close()
    assert f.host.drop_prefix(f.prefix_id) == LAYERS * HEADS * 13
    assert HostPageView.from_fetcher(f) is None  # no longer whole in the tier


def test_extra_entries_are_pool_rows_until_closed(warm) -> None:
    f, _ = warm
    host = f.host
    assert host is not None
    view = HostPageView.from_fetcher(f)
    assert view is not None
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(HEADS, 21, 16, generator=g), torch.randn(HEADS, 21, 16, generator=g)  # 2 pages a head
    used = host.used_bytes
    assert view.extra_rows(1) is None and view.set_extra(1, k, v)
    rows = view.extra_rows(1)
    assert rows is not None and rows.shape == (HEADS, 21)
    assert torch.equal(view.k[0][rows], k) and torch.equal(view.v[0][rows], v)
    assert host.used_bytes == used + HEADS * 2 * host.page_bytes
    view.close()
    assert host.used_bytes == used  # dropped with the view (and the prefix no longer held)
    assert host.drop_prefix(f.prefix_id) == LAYERS * HEADS * 13


def test_extra_entries_without_room_stay_with_the_fetcher(warm) -> None:
    f, _ = warm
    view = HostPageView.from_fetcher(f)
    assert view is not None and f.host is not None
    free = f.host.n_slots - f.host.lru.used
    k = torch.zeros(HEADS, (free // HEADS + 1) * 16, 16)
    assert not view.set_extra(0, k, k) and not view.set_extra(0, k[:, :1], k[:, :1])  # not asked again
    assert view.extra_rows(0) is None and f.host.lru.used == LAYERS * HEADS * 13
    view.close()


def test_no_view_without_a_warm_host_tier(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    m, _ = write_prefix(store, N_TOKENS)
    with PageFetcher(store, m, "cpu", OffloadConfig(gpu_cache_bytes=1 << 20)) as f:
        assert HostPageView.from_fetcher(f) is None  # no host tier
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=10 * m.layout.page_bytes)
    with PageFetcher(store, m, "cpu", OffloadConfig(gpu_cache_bytes=1 << 20), tier) as f:
        assert HostPageView.from_fetcher(f) is None  # not warm
    store.close()


ATTEND = SparsePrefixAttention.attend


@pytest.fixture(scope="module")
def stored(lm, tmp_path_factory) -> Iterator[tuple[KVStore, str]]:
    with stored_document(lm, tmp_path_factory.mktemp("view"), DOC) as s:
        yield s


def _decode(store: KVStore, pid: str, lm, method: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
            ) -> tuple[GenerationStats, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One greedy generation (the prefix warmed before its first step) and every prefix attention output."""
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = ATTEND(self, layer, q, scale)
        outs.append(out)
        return out

    monkeypatch.setattr(SparsePrefixAttention, "attend", spy)
    cfg = OffloadConfig(host_cache_bytes=64 << 20, warm_in_background=False, host_in_place=in_place, io_threads=1)
    st = GenerationStats()
    list(Worker(store, lm, progress=False, offload=cfg).generate(
        pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method=method, decode=DecodeConfig(budget=0.2),
        stats=st, raw=True))
    return st, outs


@pytest.mark.parametrize("method", list(IN_PLACE))
def test_in_place_equals_the_pool_path(stored, lm, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pid = stored
    pool, pool_outs = _decode(store, pid, lm, method, False, monkeypatch)
    view, view_outs = _decode(store, pid, lm, method, True, monkeypatch)
    assert view.token_ids == pool.token_ids and len(view.token_ids) == NEW_TOKENS
    assert len(view_outs) == len(pool_outs) == NEW_TOKENS * lm.layout.n_layers
    for (o1, s1), (o2, s2) in zip(view_outs, pool_outs, strict=True):
        assert torch.equal(o1, o2) and torch.equal(s1, s2)  # bit for bit
    x, y = view.extra, pool.extra
    assert y["offload_gpu_hits"] > 0  # the pool path served repeats from its pool ...
    if IN_PLACE[method]:  # ... the view read every page in place
        assert x["offload_gpu_hits"] == 0 and x["offload_ssd_pages"] == 0
        assert x["offload_host_pages"] == x["offload_pages_requested"] == y["offload_pages_requested"]
        # the host tier it reads is the worker's memory: the generation holds less than with a pool
        assert 0 < x["device_bytes"] < y["device_bytes"] and x["device_bytes_page_cache"] == 0
    else:  # the same fetches and memory (times apart)
        def counts(e: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in e.items() if k.startswith(("offload_", "device_bytes")) and not k.endswith("_s")}

        assert counts(x) == counts(y) and x["offload_gpu_hits"] > 0
    assert view.bytes_fetched == pool.bytes_fetched and view.prefix_tokens_per_step == pool.prefix_tokens_per_step


def test_a_cold_open_switches_to_the_view_once_warm_and_releases_it(stored, lm, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    store, pid = stored
    pool, _ = _decode(store, pid, lm, "quest", False, monkeypatch)
    gate, steps, started = threading.Event(), itertools.count(), []
    chunk, start = HostWarmup._chunk, HostWarmup.start

    def gated_chunk(self: HostWarmup, *args) -> None:  # noqa: ANN002
        gate.wait(30)
        chunk(self, *args)

    def record_start(self: HostWarmup) -> HostWarmup:
        started.append(self)
        return start(self)

    served: dict[int, int] = {}  # step -> layers the view served
    page_rows = HostPageView.page_rows

    def count(self: HostPageView, layer: int, pages: torch.Tensor, step: int) -> torch.Tensor:
        served[step] = served.get(step, 0) + 1
        return page_rows(self, layer, pages, step)

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        if next(steps) == 2:  # two steps served by the fetcher over the cold prefix; now let the warm-up finish
            gate.set()
            started[0]._thread.join(timeout=60)
        yield

    monkeypatch.setattr(HostWarmup, "_chunk", gated_chunk)
    monkeypatch.setattr(HostWarmup, "start", record_start)
    monkeypatch.setattr(HostPageView, "page_rows", count)
    w = Worker(store, lm, progress=False, offload=OffloadConfig(host_cache_bytes=64 << 20, io_threads=1))
    w.engine.turn = turn
    cold = GenerationStats()
    list(w.generate(pid, QUERY, SamplingParams(max_new_tokens=NEW_TOKENS), method="quest",
                    decode=DecodeConfig(budget=0.2), stats=cold, raw=True))
    assert cold.token_ids == pool.token_ids and started[0].complete
    assert cold.extra["offload_ssd_pages"] > 0  # the first steps read their pages from SSD ...
    assert served == {s: lm.layout.n_layers for s in range(2, NEW_TOKENS)}  # ... then every layer from the view
    host = w.host_tier()
    assert host is not None and int(host.lru.holds.sum()) == 0  # the view's hold ended with the generation
