"""Device-planned page cache: rows and (windowed) LRU against a plain Python reference over several steps and
layers, K/V equal to the store's and to ``PageFetcher``'s, device hit/miss counters, padding, the host-tier
hold; on CUDA, select + fetch + attend captured in a CUDA graph and replayed.

CPU tests run the torch plan and (under ``TRITON_INTERPRET=1``) the Triton plan and gather (the kernels
themselves: ``test_kernel_gather_pages.py``, ``test_kernel_page_plan.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from offload_helpers import HEADS, LAYERS, PAGE, open_store, write_prefix

from store.errors import InvalidInput
from store.kvstore import KVStore
from workers.kernels.page_plan import WINDOW_MIN
from workers.offload import DevicePageCache, HostTier, OffloadConfig, PageFetcher, PrefixHeld

N_TOKENS = 16 * 40 + 5  # 41 pages, the last one partial
N_PAGES = -(-N_TOKENS // PAGE)
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERP, reason="CPU tensors through Triton need TRITON_INTERPRET=1")


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(tmp_path / "home")
    yield s
    s.close()


def _fetcher(store: KVStore, m, tier: HostTier | None, gpu_pages: int = 64) -> PageFetcher:
    cfg = OffloadConfig(gpu_cache_bytes=gpu_pages * LAYERS * 2 * PAGE * 16 * 4, io_threads=1, reader="posix")
    return PageFetcher(store, m, "cpu", cfg, tier)


def _tier(m, extra_pages: int = 0) -> HostTier:
    lay = m.layout
    return HostTier(page_bytes=lay.page_bytes, budget_bytes=(LAYERS * HEADS * N_PAGES + extra_pages) * lay.page_bytes)


class RefLRU:
    """Plain Python model of one layer: per head ``s`` slots, LRU by (stamp, slot) among the plan's window of
    ``max(window_min, next_pow2(2n))`` slots rotating by its width per plan (every slot when ``s`` is no more)."""

    def __init__(self, s: int, window_min: int = WINDOW_MIN):
        self.s, self.window_min = s, window_min
        self.map: list[dict[int, int]] = [{} for _ in range(HEADS)]
        self.owner = [[-1] * s for _ in range(HEADS)]
        self.stamp = [[0] * s for _ in range(HEADS)]
        self.clock = self.hits = self.misses = 0

    def fetch(self, pages: list[list[int]]) -> list[list[int]]:
        self.clock += 1
        t, rows = self.clock, []
        for h, req in enumerate(pages):
            mp, own, st = self.map[h], self.owner[h], self.stamp[h]
            for p in req:
                if p in mp:
                    st[mp[p]] = t
            w = min(self.s, max(self.window_min, 1 << (2 * len(req) - 1).bit_length()))
            window = [((t - 1) * w + i) % self.s for i in range(w)]
            victims = iter(sorted(window, key=lambda x: (st[x], x)))
            out = []
            for p in req:
                if not 0 <= p < N_PAGES:
                    out.append(-1)
                    continue
                if p in mp:
                    self.hits += 1
                else:
                    self.misses += 1
                    v = next(victims)
                    if own[v] >= 0:
                        del mp[own[v]]
                    mp[p], own[v], st[v] = v, p, t
                out.append((h * self.s + mp[p]) * PAGE)
            rows.append(out)
        return rows


def _requests(seed: int, steps: int, p: int) -> list[list[torch.Tensor]]:
    """Per step and layer ``[HEADS, n]`` unique page ids from a drifting window, some -1 padding, n <= p."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        per_layer = []
        for _ in range(LAYERS):
            n = p if t % 3 else int(rng.integers(1, p + 1))
            lo = min(N_PAGES - 2 * p, 2 * t)
            rows = [rng.permutation(np.arange(lo, lo + 2 * p))[:n] for _ in range(HEADS)]
            req = np.stack(rows)
            req[rng.random(req.shape) < 0.15] = -1
            per_layer.append(torch.from_numpy(req.astype(np.int64)))
        out.append(per_layer)
    return out


def _check_content(r, pages: torch.Tensor, kv) -> None:
    """Rows of the result hold exactly the requested pages' K/V (tokens past the prefix excluded)."""
    k_ref, v_ref = kv
    for h in range(HEADS):
        for j, p in enumerate(pages[h].tolist()):
            if p < 0:
                assert r.rows[h, j] == -1
                continue
            row = int(r.rows[h, j])
            n = min(PAGE, N_TOKENS - p * PAGE)
            assert torch.equal(r.k[h, row : row + n], k_ref[h, p * PAGE : p * PAGE + n])
            assert torch.equal(r.v[h, row : row + n], v_ref[h, p * PAGE : p * PAGE + n])


@pytest.mark.parametrize("plan,triton_gather", [("torch", False), pytest.param("triton", True, marks=needs_triton)])
@pytest.mark.parametrize("s,window_min", [(13, WINDOW_MIN), (24, 4)])  # exact LRU; a window smaller than the head
def test_rows_lru_and_counts_match_reference(store: KVStore, plan: str, triton_gather: bool, s: int,
                                             window_min: int) -> None:
    m, _ = write_prefix(store, N_TOKENS, seed=1)
    p = 6
    tier = _tier(m)
    with _fetcher(store, m, tier) as f:
        f.warm_host()
        cache = DevicePageCache.from_fetcher(f, pages_per_call=p, slots_per_head=s, plan=plan, allow_cpu=True,
                                             window_min=window_min)
        assert cache is not None and cache.plan == plan
        cache.use_triton_gather = triton_gather
        refs = [RefLRU(s, window_min) for _ in range(LAYERS)]
        kv = [store.read_layer(m.prefix_id, layer) for layer in range(LAYERS)]
        for step in _requests(0, 9, p):
            for layer, pages in enumerate(step):
                r = cache.fetch(layer, pages)
                want = refs[layer].fetch(pages.tolist())
                assert r.rows is not None and r.rows.tolist() == want
                _check_content(r, pages, kv[layer])
                assert torch.equal(r.page_rows(pages), r.rows)
        st = cache.stats()
        assert st.hits == sum(r.hits for r in refs) and st.misses == sum(r.misses for r in refs)
        assert st.fetches == 9 * LAYERS and st.rejected == 0 and 0 < st.hit_rate < 1
        cache.close()


def test_results_equal_page_fetcher(store: KVStore) -> None:
    m, _ = write_prefix(store, N_TOKENS, seed=2)
    tier = _tier(m)
    with _fetcher(store, m, tier) as f, _fetcher(store, m, tier, gpu_pages=40) as g:
        f.warm_host()
        with DevicePageCache.from_fetcher(f, pages_per_call=8, allow_cpu=True) as cache:
            for step in _requests(3, 6, 8):
                for layer, pages in enumerate(step):
                    a, b = cache.fetch(layer, pages), g.fetch(layer, pages)
                    assert a.rows is not None and b.rows is not None
                    assert torch.equal(a.rows < 0, b.rows < 0)
                    ok = pages >= 0
                    ra = torch.where(ok, a.rows, 0).unsqueeze(-1) + torch.arange(PAGE)
                    rb = torch.where(ok, b.rows, 0).unsqueeze(-1) + torch.arange(PAGE)
                    for pool in ("k", "v"):
                        xa, xb = getattr(a, pool)[0][ra], getattr(b, pool)[0][rb]
                        assert torch.equal(xa[ok], xb[ok])


@needs_triton
def test_triton_plan_equals_torch_plan(store: KVStore) -> None:
    m, _ = write_prefix(store, N_TOKENS, seed=4)
    tier = _tier(m)
    with _fetcher(store, m, tier) as f:
        f.warm_host()
        a = DevicePageCache.from_fetcher(f, pages_per_call=7, slots_per_head=15, plan="torch", allow_cpu=True)
        b = DevicePageCache.from_fetcher(f, pages_per_call=7, slots_per_head=15, plan="triton", allow_cpu=True)
        assert a is not None and b is not None
        for step in _requests(5, 7, 7):
            for layer, pages in enumerate(step):
                a.fetch(layer, pages)
                b.fetch(layer, pages)
        for name in ("page_to_slot", "slot_to_page", "stamp", "clock", "counters", "rows", "src_rows"):
            x, y = getattr(a.state, name), getattr(b.state, name)
            if name in ("page_to_slot", "slot_to_page", "stamp"):  # the last column is scratch
                x, y = x[..., :-1], y[..., :-1]
            assert torch.equal(x, y), name
        assert all(torch.equal(x, y) for x, y in zip(a.k, b.k))
        a.close()
        b.close()


def test_precondition_falls_back_to_fetcher(store: KVStore) -> None:
    m, _ = write_prefix(store, N_TOKENS, seed=5)
    with _fetcher(store, m, None) as f:
        assert DevicePageCache.from_fetcher(f, pages_per_call=4, allow_cpu=True) is None  # no host tier
    tier = _tier(m)
    with _fetcher(store, m, tier) as f:
        f.warm_host(layers=[0, 1])  # layer 2 missing
        assert DevicePageCache.from_fetcher(f, pages_per_call=4, allow_cpu=True) is None
        f.warm_host()
        assert DevicePageCache.from_fetcher(f, pages_per_call=4) is None  # CPU device: not without allow_cpu
        with pytest.raises(ValueError, match="gpu_cache_bytes"):
            DevicePageCache.from_fetcher(f, pages_per_call=40, allow_cpu=True)
        with pytest.raises(ValueError):
            DevicePageCache.from_fetcher(f, pages_per_call=4, slots_per_head=7, allow_cpu=True)


def test_hold_pins_host_slots_until_close(store: KVStore) -> None:
    m, _ = write_prefix(store, N_TOKENS, seed=6)
    m2, _ = write_prefix(store, N_TOKENS, seed=7)
    tier = _tier(m, extra_pages=4)
    with _fetcher(store, m, tier) as f, _fetcher(store, m2, tier) as f2:
        f.warm_host()
        cache = DevicePageCache.from_fetcher(f, pages_per_call=4, allow_cpu=True)
        assert cache is not None
        before = tier.pages.clone()
        f2.warm_host(layers=[0])  # another prefix: only the 4 free slots, never the held ones
        assert torch.equal(tier.pages[: -4], before[: -4])
        f2.fetch(0, torch.arange(8).view(HEADS, 4))  # beyond the tier: served from staging, no eviction
        assert torch.equal(tier.pages[: -4], before[: -4])
        with pytest.raises(PrefixHeld):
            tier.drop_prefix(m.prefix_id)
        cache.close()
        f2.warm_host(layers=[0])  # released: evictable again
        assert not torch.equal(tier.pages[: -4], before[: -4])
        assert tier.drop_prefix(m.prefix_id) > 0


def test_invalid_requests(store: KVStore) -> None:
    m, kv = write_prefix(store, N_TOKENS, seed=8)
    tier = _tier(m)
    with _fetcher(store, m, tier) as f:
        f.warm_host()
        with DevicePageCache.from_fetcher(f, pages_per_call=4, allow_cpu=True) as cache:
            for bad in (torch.zeros(HEADS, 5, dtype=torch.int64), torch.zeros(HEADS + 1, 2, dtype=torch.int64),
                        torch.zeros(HEADS, 2)):
                with pytest.raises(InvalidInput):
                    cache.fetch(0, bad)
            with pytest.raises(InvalidInput):
                cache.fetch(LAYERS, torch.zeros(HEADS, 2, dtype=torch.int64))
            pages = torch.tensor([[0, N_PAGES], [N_PAGES - 1, -1]])
            r = cache.fetch(1, pages)
            assert r.rows is not None and r.rows[0, 1] == -1 and r.rows[1, 1] == -1
            _check_content(r, torch.where(pages < N_PAGES, pages, -1), kv[1])
            assert cache.stats().rejected == 1
            with pytest.raises(InvalidInput, match="page ids"):
                cache.check()


# -- CUDA: one graph per decode step --------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_prefix(home: Path, n: int, layers: int, heads: int):
    from store.config import StoreConfig
    from store.layout import KVLayout
    from store.prefix_key import PrefixKey, tenant_salt, token_hash

    lay = KVLayout(n_layers=layers, n_kv_heads=heads, head_dim=128, dtype="bfloat16", page_size=16)
    st = KVStore(StoreConfig(home=home, fsync=False))
    key = PrefixKey(model_fingerprint="graph", tenant_salt=tenant_salt("t"), token_hash=token_hash([n]), layout=lay)
    g = torch.Generator().manual_seed(0)
    with st.write_prefix(key, model_name="m", n_tokens=n) as w:
        for layer in range(layers):
            off = torch.randn(heads, n // 16, 1, 128, generator=g)
            k = (torch.randn(heads, n // 16, 16, 128, generator=g) + off).view(heads, n, 128)
            w.write_layer(layer, k, torch.randn(heads, n, 128, generator=g))
        m = w.commit()
    return st, m


@cuda
@pytest.mark.parametrize("plan", ["triton", "torch"])
def test_cuda_graph_step_equals_eager_and_resident(tmp_path: Path, plan: str) -> None:
    from workers.kernels.sparse_attention import sparse_decode_attention
    from workers.methods.layer_kv import ResidentKV
    from workers.methods.quest import QuestBounds, QuestSelector
    from workers.methods.selector import LayerContext

    dev = torch.device("cuda")
    layers, heads, hq, n, sel = 3, 4, 16, 16 * 200, 12
    st, m = _gpu_prefix(tmp_path / "home", n, layers, heads)
    lay = m.layout
    kv = [tuple(x.to(dev, lay.torch_dtype) for x in st.read_layer(m.prefix_id, layer)) for layer in range(layers)]
    bounds = {f"{layer}.{name}": t for layer, (k, v) in enumerate(kv)
              for name, t in QuestBounds().summarize(layer, k, v).items()}
    quest = QuestSelector(bounds)  # the product's whole-page selection, captured with the fetch
    ctxs = [LayerContext(ResidentKV(k, v, 16), 0, n) for k, v in kv]
    tok = torch.arange(16, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    qs = torch.randn(12, layers, hq, 128, device=dev, generator=g, dtype=torch.bfloat16)
    qs = qs.cumsum(0) * 0.3  # a random walk: consecutive steps overlap

    def select(q: torch.Tensor, layer: int) -> torch.Tensor:
        return quest.select_pages(layer, ctxs[layer], q.view(1, heads, -1, 128), 128**-0.5, sel)[0]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        idx = (rows.unsqueeze(-1) + tok).view(1, heads, -1)
        return sparse_decode_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=128**-0.5, idx=idx)[0]

    tier = HostTier(page_bytes=lay.page_bytes, budget_bytes=layers * heads * (n // 16) * lay.page_bytes)
    cfg = OffloadConfig(gpu_cache_bytes=1 << 26, reader="posix")
    with PageFetcher(st, m, dev, cfg, tier) as f:
        f.warm_host()
        caches = [DevicePageCache.from_fetcher(f, pages_per_call=sel, slots_per_head=3 * sel, plan=plan)
                  for _ in range(2)]
        assert all(c is not None for c in caches)
        graph_cache, eager = caches
        assert graph_cache is not None and eager is not None
        q_static = qs[0].clone()
        outs: list[torch.Tensor] = []

        def step(cache: DevicePageCache, q: torch.Tensor) -> list[torch.Tensor]:
            res = []
            for layer in range(layers):
                r = cache.fetch(layer, select(q[layer], layer))
                res.append(attend(q[layer], r.k, r.v, r.rows))
            return res

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(graph_cache, q_static)  # warm-up (compiles kernels): step 0
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(graph_cache, q_static)
        step(eager, qs[0])
        for t in range(1, qs.shape[0]):
            q_static.copy_(qs[t])
            graph.replay()
            want = step(eager, qs[t])
            for layer in range(layers):
                assert torch.equal(outs[layer], want[layer])
                pages = select(qs[t, layer], layer)
                ref = attend(qs[t, layer], kv[layer][0], kv[layer][1], pages * 16)
                assert torch.equal(outs[layer], ref)
        a, b = graph_cache.stats(), eager.stats()
        assert (a.hits, a.misses, a.fetches) == (b.hits, b.misses, b.fetches)
        assert a.fetches == qs.shape[0] * layers and 0 < a.hit_rate < 1
        for c in caches:
            c.close()
    st.close()
