"""Offloaded fetch on CPU: rows equal the store's reads across steps, exact LRU and hit accounting,
byte budgets, minimal coalesced reads, the one-launch gather (Triton interpreter), and stats."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from offload_helpers import HEADS, LAYERS, PAGE, gather_rows, layer_path, open_store, page_tokens, write_prefix

from store.errors import InvalidInput
from store.kvstore import KVStore
from store.page_io import PosixPageReader, open_page_reader, plan_runs
from workers.kernels.sparse_attention import sparse_decode_attention_ref
from workers.offload import CacheTooSmall, HostTier, OffloadConfig, PageFetcher
from workers.offload.lru import CapacityError, SlotLRU


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "home")
    yield s
    s.close()


def _cfg(pages_per_layer: int, **kw) -> OffloadConfig:
    """A config whose GPU cache holds ``pages_per_layer`` pages per layer (payload 2 x 16 x 16 x 4 B)."""
    return OffloadConfig(gpu_cache_bytes=pages_per_layer * LAYERS * 2 * PAGE * 16 * 4, io_threads=2, **kw)


def _random_pages(g: torch.Generator, n_pages: int, k: int) -> torch.Tensor:
    return torch.stack([torch.randperm(n_pages, generator=g)[:k] for _ in range(HEADS)])


# -- coalescing --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_plan_runs_is_the_minimal_set_of_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lin = np.unique(rng.integers(0, 300, 80))
    plan = plan_runs(lin)
    breaks = 1 + sum(1 for a, b in zip(lin[:-1], lin[1:]) if b != a + 1)
    assert plan.n_runs == breaks
    assert plan.counts.sum() == lin.size
    for s, c in zip(plan.starts, plan.counts):
        assert np.array_equal(lin[s : s + c], np.arange(lin[s], lin[s] + c))
    split = plan_runs(lin, max_pages=3)
    assert (split.counts <= 3).all() and split.counts.sum() == lin.size
    assert split.n_runs == sum(-(-int(c) // 3) for c in plan.counts)


def test_plan_runs_rejects_unsorted_or_duplicate() -> None:
    with pytest.raises(ValueError):
        plan_runs([3, 2])
    with pytest.raises(ValueError):
        plan_runs([2, 2])
    assert plan_runs([]).n_runs == 0


def test_posix_reader_issues_one_preadv_per_run(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    m, _ = write_prefix(store, PAGE * 20)
    lay = m.layout
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, bufs: list, off: int) -> int:
        calls.append(off)
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", counting)
    lin = np.array([0, 1, 2, 5, 19, 20, 21, 39])  # head 0 pages 0-2, 5, 19; head 1 pages 0, 1, 19
    plan = plan_runs(lin)
    out = np.zeros((lin.size, lay.page_bytes), dtype=np.uint8)
    assert PosixPageReader().read(layer_path(store, m, 1), m.files[1].size, plan, lay.page_bytes, out) == 4
    assert len(calls) == 4  # [0-2], [5], [19-21] (crosses heads: the file is [head][page]), [39]
    for i, key in enumerate(lin):
        want = torch.empty(1, lay.page_bytes, dtype=torch.uint8)
        store.read_pages(m.prefix_id, 1, int(key) // 20, [int(key) % 20], want)
        assert np.array_equal(out[i], want[0].numpy())


def test_auto_reader_is_posix_without_cuda() -> None:
    assert open_page_reader("auto", cuda=False).name == "posix"
    with pytest.raises(ValueError):
        open_page_reader("gds", cuda=False)


# -- correctness across steps ------------------------------------------------------------------
@pytest.mark.parametrize("host_pages", [None, 0, 7, 10_000])
def test_fetched_rows_equal_read_layer_across_steps(store: KVStore, host_pages: int | None) -> None:
    n = PAGE * 30 + 5
    m, kv = write_prefix(store, n)
    ref = [store.read_layer(m.prefix_id, layer, verify=True) for layer in range(LAYERS)]
    tier = None if host_pages is None else HostTier(page_bytes=m.layout.page_bytes,
                                                    budget_bytes=host_pages * m.layout.page_bytes)
    g = torch.Generator().manual_seed(3)
    with PageFetcher(store, m, "cpu", _cfg(12), tier) as f:
        for _step in range(6):
            for layer in range(LAYERS):
                pages = _random_pages(g, 31, 5)
                pages[1, -1] = -1  # padding
                r = f.fetch(layer, pages)
                assert r.rows is not None and torch.equal(r.rows, r.page_rows(pages))
                assert r.rows[1, -1] == -1 and (r.rows[pages >= 0] >= 0).all()
                tok, ok = page_tokens(pages[:, :-1], n)
                rows = r.token_rows(tok)
                assert (rows >= 0).all()
                for buf, want in ((r.k, ref[layer][0]), (r.v, ref[layer][1])):
                    got, exp = gather_rows(buf, rows), gather_rows(want, tok)
                    assert torch.equal(got[ok], exp[ok])
                assert torch.equal(ref[layer][0], kv[layer][0])
        st = f.stats
        assert st.steps == 6
        for c in st.per_step:
            assert c.pages == c.gpu_hits + c.host_pages + c.ssd_pages
        if host_pages in (None, 0):
            assert st.total.host_pages == 0
    if tier is not None:
        assert tier.used_bytes <= tier.budget_bytes


def test_sparse_attention_over_fetched_pages_equals_resident(store: KVStore) -> None:
    n = PAGE * 25
    m, kv = write_prefix(store, n)
    g = torch.Generator().manual_seed(5)
    with PageFetcher(store, m, "cpu", _cfg(8)) as f:
        for _step in range(3):
            pages = _random_pages(g, 25, 4)
            r = f.fetch(2, pages)
            assert r.rows is not None
            idx = (r.rows.unsqueeze(-1) + torch.arange(PAGE)).reshape(1, HEADS, -1)
            tok = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).reshape(1, HEADS, -1)
            q = torch.randn(1, 2 * HEADS, 16, generator=g)
            a = sparse_decode_attention_ref(q, r.k[None], r.v[None], scale=0.25, idx=idx)
            b = sparse_decode_attention_ref(q, kv[2][0][None], kv[2][1][None], scale=0.25, idx=tok)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fetch_tokens_merges_rows_and_rejects_outside_tokens(store: KVStore) -> None:
    n = PAGE * 10 + 3
    m, kv = write_prefix(store, n)
    with PageFetcher(store, m, "cpu", _cfg(10)) as f:
        tokens = torch.tensor([[[3, 40, 162, 0], [17, 18, 99, 5]], [[3, 41, 0, 0], [100, 0, 0, 0]]])
        counts = torch.tensor([[3, 4], [2, 1]])
        r = f.fetch_tokens(0, tokens, counts)
        assert r.rows is None
        resident = set(map(tuple, (r.slot_map >= 0).nonzero().tolist()))
        assert resident == {(0, 0), (0, 2), (0, 10), (1, 1), (1, 6), (1, 0)}
        rows = r.token_rows(tokens[0])
        valid = torch.arange(4) < counts[0].unsqueeze(-1)
        got = gather_rows(r.k, rows.clamp_min(0))
        exp = gather_rows(kv[0][0], tokens[0])
        assert torch.equal(got[valid], exp[valid])
        assert (r.token_rows(torch.tensor([[n, -1], [5, 5]]))[0] == -1).all()
        with pytest.raises(InvalidInput):
            f.fetch_tokens(0, torch.tensor([[[n], [0]]]), torch.tensor([[1, 1]]))
        with pytest.raises(InvalidInput):
            f.fetch(0, torch.tensor([[11], [0]]))


def test_extra_rows_follow_the_page_slots(store: KVStore) -> None:
    m, _ = write_prefix(store, PAGE * 8)
    with PageFetcher(store, m, "cpu", _cfg(4)) as f:
        f.fetch(1, torch.tensor([[0, 1], [2, 3]]))
        ek, ev = torch.randn(HEADS, 3, 16), torch.randn(HEADS, 3, 16)
        f.set_extra_rows(1, ek, ev)
        r = f.fetch(1, torch.tensor([[0, 1], [2, 3]]))  # pages stay resident across the resize
        assert r.extra_base == 4 * PAGE and r.n_extra == 3 and f.stats.per_step[1].gpu_hits == 4
        rows = r.extra_rows(torch.tensor([[0, 2], [1, 1]]))
        assert torch.equal(gather_rows(r.k, rows), torch.stack([ek[0, [0, 2]], ek[1, [1, 1]]]))
        assert torch.equal(gather_rows(r.v, rows), torch.stack([ev[0, [0, 2]], ev[1, [1, 1]]]))


# -- LRU, hits, budgets -------------------------------------------------------------------------
def test_slot_lru_allocation_order_is_exact() -> None:
    lru = SlotLRU(4)
    lru.add_namespace(0, 100)
    lru.begin_batch()
    assert lru.allocate(0, np.array([10, 11, 12])).slots.tolist() == [0, 1, 2]
    lru.begin_batch()
    lru.touch(lru.lookup(0, np.array([11])))
    assert lru.allocate(0, np.array([13])).slots.tolist() == [3]  # never-used slot first
    lru.begin_batch()
    a = lru.allocate(0, np.array([14, 15]))  # stamps: 10@1, 11@2, 12@1, 13@2 -> evict 10, 12
    assert a.slots.tolist() == [0, 2] and sorted(a.evicted_keys.tolist()) == [10, 12]
    assert lru.lookup(0, np.array([10, 12, 14, 15, 11])).tolist() == [-1, -1, 0, 2, 1]
    assert lru.evictions == 2 and lru.used == 4
    with pytest.raises(CapacityError):  # slots of this batch are never evicted
        lru.allocate(0, np.array([16, 17, 18]))
    lru.add_namespace(1, 10)
    assert lru.drop_namespace(0) == 4 and lru.used == 0


def test_gpu_cache_hits_and_evictions_are_exact(store: KVStore) -> None:
    m, _ = write_prefix(store, PAGE * 10)
    steps = [[[0, 1, 2], [-1, -1, -1]], [[1, 2, 3], [-1, -1, -1]], [[4, 5, -1], [-1, -1, -1]],
             [[0, 2, -1], [-1, -1, -1]]]
    with PageFetcher(store, m, "cpu", _cfg(4)) as f:
        for pages in steps:
            f.fetch(0, torch.tensor(pages))
        st = f.stats
    assert [c.pages for c in st.per_step] == [3, 3, 2, 2]
    assert [c.gpu_hits for c in st.per_step] == [0, 2, 0, 1]  # step 3 evicts pages 0 and 1 (LRU)
    assert [c.ssd_pages for c in st.per_step] == [3, 1, 2, 1]
    assert st.gpu_evictions == 3 and st.hit_rate == pytest.approx(3 / 10)
    assert st.read_calls == 1 + 1 + 1 + 1  # [0-2], [3], [4-5], [0]


def test_gpu_budget_is_respected_and_overflow_is_a_clear_error(store: KVStore) -> None:
    m, _ = write_prefix(store, PAGE * 10)
    cfg = OffloadConfig(gpu_cache_bytes=10_000_000)
    with PageFetcher(store, m, "cpu", cfg) as f:
        f.fetch(0, torch.tensor([[0], [1]]))
        pool_bytes = sum(c.gpu_bytes for c in f._layers.values())
        assert f.slots_per_layer * LAYERS * m.layout.page_payload_bytes <= cfg.gpu_cache_bytes
        assert pool_bytes == f.slots_per_layer * m.layout.page_payload_bytes
    with PageFetcher(store, m, "cpu", _cfg(3)) as f, pytest.raises(CacheTooSmall, match="gpu_cache_bytes"):
        f.fetch(0, torch.tensor([[0, 1], [2, 3]]))


def test_read_layer_is_the_stored_layer_and_leaves_the_page_cache_alone(store: KVStore) -> None:
    """A whole-layer read (a query-time cache's query step) goes through the tiers into a one-off pool: the
    bytes the store reads, the host tier filled for the next generation, the layer's GPU page cache untouched."""
    m, kv = write_prefix(store, PAGE * 5 + 3)  # a partial last page
    n_keys = HEADS * 6
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=LAYERS * n_keys * m.layout.page_bytes, pin=False)
    with PageFetcher(store, m, "cpu", _cfg(2), tier) as f:  # the layer is 6x the layer's page cache
        k, v = f.read_layer(1, step=0)
        sk, sv = store.read_layer(m.prefix_id, 1)
        assert torch.equal(k, sk) and torch.equal(v, sv) and torch.equal(k, kv[1][0]) and torch.equal(v, kv[1][1])
        assert (f.stats.total.pages, f.stats.total.ssd_pages, f.stats.overflow_fetches) == (n_keys, n_keys, 0)
        f.fetch(1, torch.tensor([[0], [5]]))  # the layer's own cache holds none of the read's pages
        assert (f.stats.total.gpu_hits, f.stats.total.host_pages) == (0, 2)
    with PageFetcher(store, m, "cpu", _cfg(2), tier) as f:  # the next generation: all from the host tier
        k2, v2 = f.read_layer(1)
        assert torch.equal(k2, k) and torch.equal(v2, v)
        assert (f.stats.total.host_pages, f.stats.total.ssd_pages) == (n_keys, 0)
    with PageFetcher(store, m, "cpu", _cfg(2)) as f, pytest.raises(InvalidInput, match="layer"):
        f.read_layer(LAYERS)


def test_host_tier_is_shared_across_generations_under_its_budget(store: KVStore) -> None:
    m, _ = write_prefix(store, PAGE * 12)
    m2, _ = write_prefix(store, PAGE * 12, seed=1)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=10 * m.layout.page_bytes + 100, pin=False)
    assert tier.n_slots == 10 and not tier.pinned
    pages = torch.tensor([[0, 1, 2], [3, 4, 5]])
    with PageFetcher(store, m, "cpu", _cfg(8), tier) as f:
        f.fetch(0, pages)
        assert f.stats.total.ssd_pages == 6
    with PageFetcher(store, m, "cpu", _cfg(8), tier) as f:  # a second generation: all from the host tier
        f.fetch(0, pages)
        assert (f.stats.total.host_pages, f.stats.total.ssd_pages) == (6, 0)
        assert f.stats.bytes_host == 6 * m.layout.page_payload_bytes and f.stats.bytes_ssd == 0
    with PageFetcher(store, m2, "cpu", _cfg(8), tier) as f:  # another prefix evicts the LRU pages
        f.fetch(1, pages)
        assert f.stats.total.ssd_pages == 6
    assert tier.used_bytes == tier.budget_bytes == 10 * m.layout.page_bytes
    assert tier.lru.evictions == 2
    with PageFetcher(store, m, "cpu", _cfg(8), tier) as f:
        f.fetch(0, pages)
        assert (f.stats.total.host_pages, f.stats.total.ssd_pages) == (4, 2)
    assert tier.drop_prefix(m2.prefix_id) > 0
    assert HostTier.from_config(m.layout, OffloadConfig(host_cache_bytes=0)) is None
    built = HostTier.from_config(m.layout, OffloadConfig(host_cache_bytes=3 * m.layout.page_bytes, pin_memory=False))
    assert built is not None and built.n_slots == 3


def test_warm_host_then_no_ssd_reads(store: KVStore) -> None:
    m, kv = write_prefix(store, PAGE * 9 + 1)
    tier = HostTier(page_bytes=m.layout.page_bytes, budget_bytes=LAYERS * HEADS * 10 * m.layout.page_bytes)
    with PageFetcher(store, m, "cpu", _cfg(10), tier) as f:
        assert f.warm_host() == LAYERS * HEADS * 10 * m.layout.page_bytes
        assert f.warm_host() == 0
        r = f.fetch(2, torch.tensor([[9, 0], [4, 5]]))
        assert f.stats.total.ssd_pages == 0 and f.stats.total.host_pages == 4
        assert torch.equal(r.k[0, r.token_rows(torch.tensor([[144], [64]]))[0, 0]], kv[2][0][0, 144])


def test_stats_as_dict_has_every_counter(store: KVStore) -> None:
    m, _ = write_prefix(store, PAGE * 4)
    with PageFetcher(store, m, "cpu", _cfg(4)) as f:
        with f.stats.timed("select"):
            f.fetch(0, torch.tensor([[0, 1], [2, 3]]))
        d = f.stats.as_dict()
    for k in ("steps", "pages_requested", "gpu_hits", "host_pages", "ssd_pages", "hit_rate", "bytes_gpu_hit",
              "bytes_host", "bytes_ssd", "read_calls", "select_s", "fetch_s", "attend_s"):
        assert isinstance(d[f"offload_{k}"], float)
    assert d["offload_pages_requested"] == 4 and d["offload_bytes_ssd"] == 4 * f.layout.page_bytes
    assert d["offload_select_s"] >= d["offload_fetch_s"] > 0
