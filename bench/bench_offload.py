"""Offloaded sparse decode vs dense attention, side by side in one run (issue 5's "must show").

Llama-3.1-8B attention shape (32 layers, 32 q heads, 8 KV heads, D=128, bf16, page 16), random
K/V (performance does not depend on values; keys get a per-page offset so pages differ). Per
decode token (attention part over all layers: select + fetch + attend), B=1:

- (a) dense SDPA with the whole KV resident in HBM;
- (b) full attention fetching the whole KV each step from the same tier (host: one pinned copy
  per layer; SSD: whole layer files, measured on a few layers and scaled to all);
- (i) sparse, KV in the pinned host tier; (ii) sparse, KV on SSD page files (O_DIRECT, no host
  tier); both through ``workers.offload.PageFetcher`` with a GPU page cache;
- (r) the same sparse selection + kernel over KV resident in HBM (no fetch: the floor), eager and
  captured in one CUDA graph per token (r-graph);
- (g) sparse, KV in the pinned host tier, through ``workers.offload.DevicePageCache`` (lookup, LRU and
  gather planned on the GPU, no sync): select + fetch + attend of all layers captured in one CUDA
  graph, replayed per token (layers strictly sequential in the graph); also eager, and with the
  torch-ops plan instead of the one-launch Triton plan.

Selection: the product's whole-page Quest step (``QuestSelector.select_pages`` over the stored page
bounds, ``page_step``): the top pages per KV head at the budget plus the anchor pages (the first and
the last page: sink and tail are one page each); queries follow a random walk per layer (``--alpha``)
so consecutive steps overlap (overlap and hit rate are reported). Also: fetch bandwidth vs the pinned host->GPU copy
and raw disk read measured in this run, and a prefill write through the store writer vs raw disk
write. Ratios are the result; absolute times are for reference.

    python3 bench/bench_offload.py --ctx 32768 131072 --json out.json
    python3 bench/bench_offload.py --quick          # CPU smoke run (tiny shape)
    python3 bench/bench_offload.py --no-ssd         # host-tier rows only (skips the SSD section)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import drop_os_cache  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from store.layout import KVLayout  # noqa: E402
from store.manifest import Manifest  # noqa: E402
from store.page_io import PosixPageReader, kvikio_available, plan_runs  # noqa: E402
from store.pages import unpack_pages  # noqa: E402
from store.prefix_key import PrefixKey, tenant_salt, token_hash  # noqa: E402
from workers.kernels.gather_pages import GatherConfig, gather_pages  # noqa: E402
from workers.kernels.page_plan import plan_pages  # noqa: E402
from workers.methods.base import mid_range  # noqa: E402
from workers.methods.layer_kv import ResidentKV  # noqa: E402
from workers.methods.page_step import page_plan, step_pages  # noqa: E402
from workers.methods.quest import QuestBounds, QuestSelector  # noqa: E402
from workers.methods.selector import LayerContext  # noqa: E402
from workers.offload import DevicePageCache, HostTier, OffloadConfig, PageFetcher  # noqa: E402
from workers.offload.memory import HostBuffer  # noqa: E402


@dataclass(frozen=True)
class Shape:
    layers: int
    hq: int
    hkv: int
    d: int
    page: int
    dtype: torch.dtype


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS: dict = {"device": "", "ctx": {}}
T_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


# -- ceilings ------------------------------------------------------------------------------------
def h2d_ceiling(nbytes: int) -> float:
    """Pinned host -> GPU copy, GB/s (median of 5)."""
    if DEV.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def disk_ceilings(path: Path, nbytes: int) -> tuple[float, float, str]:
    """Raw sequential write (with fsync) and cold read of one file, GB/s each, and how read was cold."""
    chunk = 64 << 20
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // chunk):
            f.write(buf.data)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0) / 1e9
    dropped = drop_os_cache()
    aligned = mmap.mmap(-1, chunk)
    mode = "O_DIRECT" if hasattr(os, "O_DIRECT") else "buffered"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd, mode = os.open(path, os.O_RDONLY), "buffered"
    t0 = time.perf_counter()
    done = 0
    while done < nbytes:
        done += os.preadv(fd, [aligned], done)
    read = nbytes / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    path.unlink()
    return write, read, mode + (", caches dropped" if dropped else "")


# -- data ----------------------------------------------------------------------------------------
def gen_layer(shape: Shape, ctx: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V ``[Hkv, ctx, D]`` (keys with a per-page offset), deterministic per layer."""
    g = torch.Generator(device=DEV).manual_seed(1000 + layer)
    n_pages = -(-ctx // shape.page)
    off = torch.randn(shape.hkv, n_pages, 1, shape.d, device=DEV, generator=g)
    k = torch.randn(shape.hkv, n_pages, shape.page, shape.d, device=DEV, generator=g) + off
    k = k.view(shape.hkv, -1, shape.d)[:, :ctx]
    v = torch.randn(shape.hkv, ctx, shape.d, device=DEV, generator=g)
    return k.to(shape.dtype).contiguous(), v.to(shape.dtype)


def write_prefix(store: KVStore, shape: Shape, ctx: int) -> tuple[Manifest, float, dict[str, torch.Tensor]]:
    """Prefill write of random K/V through the store writer; (manifest, seconds in the writer, the
    ``QuestBounds`` artifact of every layer, on the device)."""
    lay = KVLayout(n_layers=shape.layers, n_kv_heads=shape.hkv, head_dim=shape.d,
                   dtype=str(shape.dtype).removeprefix("torch."), page_size=shape.page)
    key = PrefixKey(model_fingerprint=f"bench-offload-{ctx}", tenant_salt=tenant_salt("bench"),
                    token_hash=token_hash([ctx]), layout=lay)
    secs, bnd = 0.0, {}
    summarizer = QuestBounds()
    with store.write_prefix(key, model_name="bench", n_tokens=ctx) as w:
        for layer in range(shape.layers):
            k, v = gen_layer(shape, ctx, layer)
            bnd.update({f"{layer}.{name}": t for name, t in summarizer.summarize(layer, k, v).items()})
            kc, vc = k.cpu(), v.cpu()
            del k, v
            t0 = time.perf_counter()
            w.write_layer(layer, kc, vc)
            secs += time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = w.commit()
        secs += time.perf_counter() - t0
    return manifest, secs, bnd


# -- decode steps --------------------------------------------------------------------------------
class Workload:
    """Per-layer queries (random walk over steps) and the product's whole-page Quest selection."""

    def __init__(self, shape: Shape, ctx: int, budget: float, bnd: dict[str, torch.Tensor], alpha: float,
                 steps: int, kv: ResidentKV):
        self.shape, self.ctx = shape, ctx
        self.n_pages = ctx // shape.page
        self.k_sel = max(1, round(budget * self.n_pages) - 2)
        self.selector = QuestSelector(bnd)
        assert self.selector.page_size == shape.page, "the stored Quest bounds are per store page"
        lo, hi = mid_range(ctx, shape.page, shape.page)  # sink and tail: the first and the last page
        self.layer_ctx = LayerContext(kv, lo, hi)
        self.plan = page_plan(anchors=self.layer_ctx.anchors, lo=lo, hi=hi, page_size=shape.page,
                              k=self.k_sel * shape.page, n_heads=shape.hkv)
        assert self.plan.n_pages == self.k_sel
        g = torch.Generator(device=DEV).manual_seed(7)
        q = torch.randn(shape.layers, shape.hq, shape.d, device=DEV, generator=g)
        qs = []
        for _ in range(steps):
            q = alpha * q + math.sqrt(1 - alpha**2) * torch.randn(q.shape, device=DEV, generator=g)
            qs.append(q.to(shape.dtype))
        self.q = torch.stack(qs)  # [steps, layers, Hq, D]
        self.scale = shape.d**-0.5
        self.tok = torch.arange(shape.page, device=DEV)

    def select(self, step: int, layer: int) -> torch.Tensor:
        """Page ids ``[Hkv, k_sel + 2]``: the top pages by Quest upper bound, then the first and last page."""
        return self.select_q(self.q[step, layer], layer)

    def select_q(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """``select`` for a query ``[Hq, D]`` (a static buffer under CUDA-graph capture)."""
        qg = q.view(1, self.shape.hkv, -1, self.shape.d)
        picked = self.selector.select_pages(layer, self.layer_ctx, qg, self.scale, self.plan.n_pages)
        return step_pages(self.plan, picked[0])

    def attend(self, step: int, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Sparse kernel over page rows ``[Hkv, n]`` (first row of each page) of buffers ``[Hkv, S, D]``."""
        return self.attend_q(self.q[step, layer], k, v, rows)

    def attend_q(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``attend`` for a query ``[Hq, D]``."""
        idx = (rows.unsqueeze(-1) + self.tok).reshape(1, self.shape.hkv, -1)
        q = q.unsqueeze(0)
        from workers.kernels.sparse_attention import sparse_decode_attention, sparse_decode_attention_ref

        op = sparse_decode_attention if DEV.type == "cuda" else sparse_decode_attention_ref
        return op(q, k.unsqueeze(0), v.unsqueeze(0), scale=self.scale, idx=idx)[0]


def per_token(fn, steps: range, budget_s: float = float("inf")) -> list[float]:
    """Wall seconds of each token (all layers), synchronized at token boundaries; stops early once
    ``budget_s`` is spent (at least one token)."""
    out: list[float] = []
    for t in steps:
        if out and sum(out) > budget_s:
            break
        sync()
        t0 = time.perf_counter()
        fn(t)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def overlap(w: Workload, steps: int) -> float:
    """Mean fraction of a step's selected pages also selected at the previous step."""
    fr = []
    for layer in range(w.shape.layers):
        prev = None
        for t in range(steps):
            s = torch.zeros(w.shape.hkv, w.n_pages, dtype=torch.bool, device=DEV)
            s.scatter_(1, w.select(t, layer), True)
            if prev is not None:
                fr.append(((s & prev).sum() / s.sum()).item())
            prev = s
    return statistics.mean(fr)


def sparse_tokens(w: Workload, fetcher: PageFetcher, steps: range, stats_sync: bool = False,
                  budget_s: float = float("inf")) -> list[float]:
    """Per-token time of the offloaded sparse path (select + fetch + attend over all layers)."""
    st = fetcher.stats
    st.sync_timing = stats_sync

    def token(t: int) -> None:
        for layer in range(w.shape.layers):
            with st.timed("select", DEV):
                pages = w.select(t, layer)
            r = fetcher.fetch(layer, pages)
            assert r.rows is not None
            with st.timed("attend", DEV):
                w.attend(t, layer, r.k, r.v, r.rows)

    return per_token(token, steps, budget_s)


def resident_tokens(w: Workload, k: torch.Tensor, v: torch.Tensor, steps: range) -> list[float]:
    """Same selection + kernel over KV resident in HBM (layer 0's buffers for every layer)."""
    def token(t: int) -> None:
        for layer in range(w.shape.layers):
            pages = w.select(t, layer)
            w.attend(t, layer, k, v, pages * w.shape.page)

    return per_token(token, steps)


def dense_tokens(w: Workload, k: torch.Tensor, v: torch.Tensor, reps: int) -> list[float]:
    """(a): SDPA over the whole resident KV per layer (layer 0's buffers for every layer)."""
    kk, vv = k.unsqueeze(0), v.unsqueeze(0)

    def token(t: int) -> None:
        for layer in range(w.shape.layers):
            q = w.q[t % w.q.shape[0], layer].view(1, w.shape.hq, 1, w.shape.d)
            F.scaled_dot_product_attention(q, kk, vv, scale=w.scale, enable_gqa=True)

    return per_token(token, range(reps))


def full_host_tokens(w: Workload, tier: HostTier, first_slot: list[int], lay: KVLayout, reps: int) -> list[float]:
    """(b) host: per layer, one pinned copy of the layer's pages to the GPU, unpack, SDPA."""
    n_layer = lay.n_kv_heads * w.n_pages
    raw = torch.empty(n_layer, lay.page_bytes, dtype=torch.uint8, device=DEV)

    def token(t: int) -> None:
        for layer in range(w.shape.layers):
            s0 = first_slot[layer]
            raw.copy_(tier.pages[s0 : s0 + n_layer], non_blocking=True)
            k, v = unpack_pages(lay, raw.view(lay.n_kv_heads, w.n_pages, -1))
            q = w.q[t % w.q.shape[0], layer].view(1, w.shape.hq, 1, w.shape.d)
            F.scaled_dot_product_attention(q, k.reshape(1, lay.n_kv_heads, -1, lay.head_dim),
                                           v.reshape(1, lay.n_kv_heads, -1, lay.head_dim), scale=w.scale,
                                           enable_gqa=True)

    return per_token(token, range(reps))


def full_ssd_layer_s(w: Workload, store: KVStore, manifest, n_layers: int) -> tuple[float, float]:
    """(b) SSD: seconds per layer reading whole layer files (O_DIRECT, 8 threads) + copy + SDPA; and GB/s."""
    from concurrent.futures import ThreadPoolExecutor

    lay = manifest.layout
    n_layer = lay.n_kv_heads * w.n_pages
    staging = HostBuffer(n_layer * lay.page_bytes, pin=DEV.type == "cuda")
    buf = staging.tensor.view(n_layer, lay.page_bytes)
    pool = ThreadPoolExecutor(8)
    reader = PosixPageReader(pool=pool, depth=8, direct=True)
    plan = plan_runs(np.arange(n_layer))
    drop_os_cache()
    sync()
    t0 = time.perf_counter()
    read_s = 0.0
    for layer in range(n_layers):
        f = manifest.files[layer]
        r0 = time.perf_counter()
        reader.read(store.prefix_dir(manifest.prefix_id) / f.name, f.size, plan, lay.page_bytes, buf.numpy())
        read_s += time.perf_counter() - r0
        raw = buf.to(DEV, non_blocking=True)
        k, v = unpack_pages(lay, raw.view(lay.n_kv_heads, w.n_pages, -1))
        q = w.q[0, layer].view(1, w.shape.hq, 1, w.shape.d)
        F.scaled_dot_product_attention(q, k.reshape(1, lay.n_kv_heads, -1, lay.head_dim),
                                       v.reshape(1, lay.n_kv_heads, -1, lay.head_dim), scale=w.scale, enable_gqa=True)
    sync()
    per_layer = (time.perf_counter() - t0) / n_layers
    reader.close()
    pool.shutdown()
    staging.close()
    return per_layer, n_layers * n_layer * lay.page_bytes / read_s / 1e9


def gather_bandwidth(tier: HostTier, lay: KVLayout, m: int, config: GatherConfig, reps: int = 20) -> float:
    """Kernel-only GB/s (K+V payload) of one gather of ``m`` random host-tier pages into GPU slots."""
    if DEV.type != "cuda":
        return float("nan")
    g = torch.Generator().manual_seed(3)
    src = torch.randperm(tier.n_slots, generator=g)[:m].to(DEV)
    dst = torch.arange(m, device=DEV)
    kp = torch.empty(m * lay.page_size, lay.head_dim, dtype=lay.torch_dtype, device=DEV)
    vp = torch.empty_like(kp)
    gather_pages(tier.pages, src, kp, vp, dst, block_bytes=lay.block_bytes, config=config)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        gather_pages(tier.pages, src, kp, vp, dst, block_bytes=lay.block_bytes, config=config)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return m * lay.page_payload_bytes / statistics.median(times) / 1e9


def gather_name(cfg: GatherConfig) -> str:
    return f"{'page' if cfg.whole_page else cfg.block_bytes}B/w{cfg.num_warps}"


STEP_GATHER_CONFIGS = tuple(GatherConfig(block_bytes=b, num_warps=nw)
                            for b, nw in ((4096, 4), (2048, 4), (1024, 4), (4096, 8), (2048, 2)))
"""Gather kernel configs tried on one step's pages (the fetcher's launches)."""


def gather_section(res: dict, tier: HostTier, lay: KVLayout, w: Workload, ceil: dict) -> GatherConfig:
    """Sweep the gather kernel's chunk size and warps on one step's pages; the best, for this run's fetchers."""
    step = w.shape.hkv * (w.k_sel + 2)
    sweep = {gather_name(cfg): (cfg, gather_bandwidth(tier, lay, step, cfg)) for cfg in STEP_GATHER_CONFIGS}
    best = max(sweep, key=lambda k: sweep[k][1] if not math.isnan(sweep[k][1]) else -1)
    res["gather_sweep_gbps"], res["gather_config"] = {k: v[1] for k, v in sweep.items()}, best
    res["gather_gbps_step"] = sweep[best][1]
    res["gather_gbps_big"] = gather_bandwidth(tier, lay, min(tier.n_slots, 65536), sweep[best][0])
    res["gather_frac"] = res["gather_gbps_step"] / ceil["h2d_gbps"]
    log(f"  gather sweep (GB/s, {step} pages): {res['gather_sweep_gbps']}; 64k pages {res['gather_gbps_big']:.1f}")
    return sweep[best][0]


def check_equal(w: Workload, fetcher: PageFetcher, k0: torch.Tensor, v0: torch.Tensor) -> float:
    """max |offloaded - resident| of layer 0's sparse output at step 0 (same selection, same kernel)."""
    pages = w.select(0, 0)
    r = fetcher.fetch(0, pages)
    assert r.rows is not None and torch.equal(r.rows, r.page_rows(pages))
    a = w.attend(0, 0, r.k, r.v, r.rows).float()
    b = w.attend(0, 0, k0, v0, pages * w.shape.page).float()
    return (a - b).abs().max().item()


# -- (g): the device-planned cache, one CUDA graph per token ----------------------------------------
class GraphStep:
    """select + fetch + attend of every layer (strictly in order) for a static query buffer; eager, or
    captured once in a CUDA graph and replayed per token."""

    def __init__(self, w: Workload, fetch):
        self.w, self.fetch = w, fetch  # fetch(layer, pages) -> (k [Hkv, S, D], v, rows [Hkv, n])
        self.q = w.q[0].clone()  # [layers, Hq, D]
        self.outs: list[torch.Tensor] = []
        self.pages: list[torch.Tensor] = []  # the last step's selection per layer
        self.graph: torch.cuda.CUDAGraph | None = None

    def run(self) -> list[torch.Tensor]:
        outs, self.pages = [], []
        for layer in range(self.w.shape.layers):
            self.pages.append(self.w.select_q(self.q[layer], layer))
            k, v, rows = self.fetch(layer, self.pages[-1])
            outs.append(self.w.attend_q(self.q[layer], k, v, rows))
        return outs

    def capture(self, warm_steps: range) -> None:
        """Run ``warm_steps`` eagerly on a side stream (kernel compilation, cold cache), then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for t in warm_steps:
                self.token(t)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outs = self.run()

    def token(self, t: int) -> None:
        self.q.copy_(self.w.q[t])
        if self.graph is not None:
            self.graph.replay()
        else:
            self.outs = self.run()


def cache_fetch(cache: DevicePageCache):
    def fetch(layer: int, pages: torch.Tensor):
        r = cache.fetch(layer, pages)
        return r.k, r.v, r.rows
    return fetch


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of ``fn``'s kernels captured in one CUDA graph (after one eager call)."""
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def graph_gather_gbps(cache: DevicePageCache, config: GatherConfig | None = None) -> tuple[float, float, int]:
    """The last step's gathers of every layer (its src rows / slots, hits skipped) replayed alone in a CUDA
    graph with ``config`` (default: the cache's): (K+V GB/s, ms per token, pages). Rewrites the same pages
    into the same slots."""
    st, lay = cache.state, cache.layout
    src, dst = st.src_rows.clone(), st.dst_slots.clone()
    pages = int((src >= 0).sum().item())

    def gathers() -> None:
        for layer in range(lay.n_layers):
            gather_pages(cache.host.pages, src[layer], cache.k[layer], cache.v[layer], dst[layer],
                         block_bytes=lay.block_bytes, use_triton=True, skip_negative=True,
                         config=config or cache.gather)

    ms = graph_ms(gathers)
    return pages * lay.page_payload_bytes / ms / 1e6, ms, pages


GATHER_CONFIGS = tuple(GatherConfig(block_bytes=b, num_warps=nw, whole_page=wp)
                       for b, nw, wp in ((4096, 4, False), (2048, 4, False), (1024, 4, False), (1024, 2, False),
                                         (512, 1, False), (8192, 4, True), (8192, 8, True)))
"""Gather kernel configs tried on the graph path: chunk bytes and warps, or one program per page."""


def tune_graph_path(args, res, w: Workload, fetcher: PageFetcher) -> tuple[GatherConfig, int]:
    """Before (g) is timed: on a scratch cache at steady state (eager steps 0..3), replay the last step's
    gathers (per gather config) and plans (per warps) of every layer in a CUDA graph; the fastest gather
    config and plan warps."""
    p = w.k_sel + 2
    cache = DevicePageCache.from_fetcher(fetcher, pages_per_call=p, slots_per_head=args.cache_factor * p)
    assert cache is not None
    gs = GraphStep(w, cache_fetch(cache))
    for t in range(4):
        gs.token(t)
    gathers = {gather_name(cfg): (cfg, graph_gather_gbps(cache, cfg)[0]) for cfg in GATHER_CONFIGS}
    best = max(gathers, key=lambda k: gathers[k][1])
    plans = {}
    for warps in (1, 2, 4, 8):
        plans[warps] = graph_ms(lambda n=warps: [plan_pages(cache.state, layer, gs.pages[layer], use_triton=True,
                                                            num_warps=n) for layer in range(w.shape.layers)])
    plan_warps = min(plans, key=lambda k: plans[k])  # 0 (auto) is one of those
    select = graph_ms(lambda: [w.select_q(gs.q[layer], layer) for layer in range(w.shape.layers)])
    res["g_tune"] = {"gather_gbps": {k: v[1] for k, v in gathers.items()}, "gather_best": best,
                     "plan_ms_per_token": plans, "plan_warps": plan_warps, "select_ms_per_token": select}
    log(f"  graph-path tuning: {res['g_tune']}")
    cache.close()
    return gathers[best][0], plan_warps


def kernel_profile(gs: GraphStep, steps: range) -> dict:
    """GPU kernel time per token by kernel name (torch profiler over graph replays), and its total."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in steps:
            gs.token(t)
        sync()
    per: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us and ev.key and not ev.key.startswith("ProfilerStep"):
            per[ev.key[:60]] = us / 1e3 / len(steps)
    top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:10])
    return {"kernel_ms_per_token": sum(per.values()), "top_kernels_ms": top}


def graph_section(args, res, w: Workload, fetcher: PageFetcher, k0, v0) -> None:
    """(r-graph) and the (g) variants over the warmed host tier; hit rate, gather bandwidth, exactness."""
    cuda = DEV.type == "cuda"
    p = w.k_sel + 2
    steps = range(2, args.steps)
    if cuda:
        rg = GraphStep(w, lambda layer, pages: (k0, v0, pages * w.shape.page))
        rg.capture(range(0, 2))
        res["resident_graph_ms"] = med_ms(per_token(rg.token, steps))
        del rg
    gather, plan_warps = fetcher.gather, 0
    if cuda:
        with guard(res, "g_tune"):
            gather, plan_warps = tune_graph_path(args, res, w, fetcher)
    variants = [("triton", True), ("triton", False), ("torch", True)] if cuda else [("torch", False)]
    for plan, graphed in variants:
        name = f"g_{plan}_{'graph' if graphed else 'eager'}"
        cache = DevicePageCache.from_fetcher(fetcher, pages_per_call=p, slots_per_head=args.cache_factor * p,
                                             plan=plan, allow_cpu=not cuda, gather=gather, plan_warps=plan_warps)
        if cache is None:
            res["graph_error"] = "DevicePageCache precondition not met (host tier not warm / not mapped)"
            return
        gs = GraphStep(w, cache_fetch(cache))
        if graphed:
            gs.capture(range(0, 2))
        else:
            for t in range(0, 2):
                gs.token(t)
        s0 = cache.stats()
        times = per_token(gs.token, steps)
        s1 = cache.stats()
        hits, misses = s1.hits - s0.hits, s1.misses - s0.misses
        res[f"{name}_ms"] = med_ms(times)
        res[f"{name}_hit_rate"] = hits / max(1, hits + misses)
        res[f"{name}_host_pages_per_token"] = misses / len(times)
        if (plan, graphed) == variants[0]:
            t = steps[-1]
            ref = w.attend(t, 0, k0, v0, w.select(t, 0) * w.shape.page)
            res["g_max_abs_diff"] = (gs.outs[0].float() - ref.float()).abs().max().item()
            res["g_gpu_cache_gb"] = cache.gpu_bytes / 1e9
            if cuda:
                with guard(res, "g_profile"):
                    res["g_profile"] = kernel_profile(gs, range(args.steps, args.steps + 5))
                gbps, ms, pages = graph_gather_gbps(cache)
                res["g_gather_gbps"], res["g_gather_ms_per_token"], res["g_gather_pages"] = gbps, ms, pages
                res["g_gather_frac"] = gbps / RESULTS["ceilings"]["h2d_gbps"]
        log(f"  ({name}) {res[f'{name}_ms']:.2f} ms/token, hit {res[f'{name}_hit_rate']:.3f}, "
            f"{res[f'{name}_host_pages_per_token']:.0f} host pages/token")
        del gs
        cache.close()
    if cuda:
        log(f"  (r-graph) {res['resident_graph_ms']:.2f} ms/token; graph gather {res.get('g_gather_gbps', 0):.1f} "
            f"GB/s ({100 * res.get('g_gather_frac', 0):.0f}% of pinned copy); profile {res.get('g_profile')}")


# -- one context ---------------------------------------------------------------------------------
def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def run_ctx(args, shape: Shape, ctx: int, home: Path, ceil: dict) -> dict:
    res: dict = {"ctx": ctx}
    store = KVStore(StoreConfig(home=home / f"store-{ctx}", page_size=shape.page))
    log(f"ctx {ctx}: prefill write through the store writer ...")
    manifest, wsecs, bnd = write_prefix(store, shape, ctx)
    lay = manifest.layout
    kv_bytes = shape.layers * shape.hkv * ctx * lay.token_kv_bytes()
    res["write_s"], res["write_gbps"] = wsecs, kv_bytes / wsecs / 1e9
    res["write_frac"] = res["write_gbps"] / ceil["disk_write_gbps"]
    log(f"  wrote {kv_bytes / 1e9:.2f} GB of KV in {wsecs:.1f} s = {res['write_gbps']:.2f} GB/s")
    k0, v0 = gen_layer(shape, ctx, 0)
    w = Workload(shape, ctx, args.budget, bnd, args.alpha, args.steps + 8, ResidentKV(k0, v0, shape.page))
    res["pages_per_head"] = w.k_sel + 2
    res["overlap"] = overlap(w, min(8, args.steps))
    res["dense_ms"] = med_ms(dense_tokens(w, k0, v0, args.reps))
    res["resident_sparse_ms"] = med_ms(resident_tokens(w, k0, v0, range(1, args.steps)))
    log(f"  (a) dense {res['dense_ms']:.2f} ms/token, (r) resident sparse {res['resident_sparse_ms']:.2f}")
    step_pages = shape.hkv * (w.k_sel + 2)
    gpu_bytes = args.cache_factor * step_pages * lay.page_payload_bytes * shape.layers
    res["gpu_cache_gb"] = gpu_bytes / 1e9
    gather = host_section(args, res, w, store, manifest, lay, gpu_bytes, k0, v0, ceil)
    if not args.no_ssd:
        with guard(res, "ssd"):
            ssd_section(args, res, w, store, manifest, gpu_bytes, k0, v0, ceil, gather)
    store.close()
    shutil.rmtree(home / f"store-{ctx}", ignore_errors=True)
    return res


@contextlib.contextmanager
def guard(res: dict, name: str):
    """Report a failed section and go on (a benchmark, not product code)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - print and continue with the other sections
        traceback.print_exc()
        res[f"{name}_error"] = f"{type(e).__name__}: {e}"


def host_section(args, res, w, store, manifest, lay, gpu_bytes, k0, v0, ceil) -> GatherConfig:
    """Rows (b) host, (i), (r-graph), (g); the gather config the sweep picked (for the SSD fetchers)."""
    n_all = lay.n_layers * lay.n_kv_heads * w.n_pages
    tier = HostTier(page_bytes=lay.page_bytes, budget_bytes=n_all * lay.page_bytes)
    cfg = OffloadConfig(gpu_cache_bytes=gpu_bytes, host_cache_bytes=tier.budget_bytes, io_depth=args.threads,
                        io_threads=min(args.threads, 64))
    with PageFetcher(store, manifest, DEV, cfg, tier) as warmer:
        t0 = time.perf_counter()
        warm = warmer.warm_host()
    res["host_warm_gbps"] = warm / (time.perf_counter() - t0) / 1e9
    res["host_pinned"] = tier.pinned
    log(f"  host tier warmed: {warm / 1e9:.2f} GB at {res['host_warm_gbps']:.2f} GB/s (verified), pinned={tier.pinned}")
    n_layer = lay.n_kv_heads * w.n_pages
    slots = [tier.lookup(manifest.prefix_id, layer * n_layer + np.arange(n_layer)) for layer in range(lay.n_layers)]
    assert all((np.diff(s) == 1).all() for s in slots), "a fresh tier holds each layer contiguously"
    first = [int(s[0]) for s in slots]
    gather = gather_section(res, tier, lay, w, ceil)
    fetcher = PageFetcher(store, manifest, DEV, cfg, tier, gather=gather)
    res["full_host_ms"] = med_ms(full_host_tokens(w, tier, first, lay, args.full_reps))
    cold = sparse_tokens(w, fetcher, range(0, 1))
    steady = sparse_tokens(w, fetcher, range(1, args.steps))
    res["max_abs_diff_host"] = check_equal(w, fetcher, k0, v0)
    res["sparse_host_first_ms"], res["sparse_host_ms"] = med_ms(cold), med_ms(steady)
    res["hit_rate_host"] = fetcher.stats.hit_rate
    res["host_fetch_cpu_ms_per_token"] = fetcher.stats.seconds["fetch"] * 1e3 / fetcher.stats.steps
    stats0 = dict(fetcher.stats.seconds)
    sparse_tokens(w, fetcher, range(args.steps, args.steps + 5), stats_sync=True)
    res["breakdown_host_ms"] = {k: (fetcher.stats.seconds.get(k, 0.0) - stats0.get(k, 0.0)) * 1e3 / 5
                                for k in ("select", "fetch", "attend", "plan", "sources", "to_device", "launch")}
    fetched = fetcher.stats.total.host_pages
    res["host_pages_per_token"] = fetched / fetcher.stats.steps
    res["gather_mode"] = fetcher.gather_mode
    with guard(res, "graph"):
        graph_section(args, res, w, fetcher, k0, v0)
    log(f"  (b) host full {res['full_host_ms']:.1f} ms/token; (i) sparse host {res['sparse_host_ms']:.2f} "
        f"(first {res['sparse_host_first_ms']:.2f}); hit {res['hit_rate_host']:.3f}; "
        f"breakdown {res['breakdown_host_ms']}")
    fetcher.close()
    tier.close()
    del fetcher, tier
    gc.collect()
    return gather


def ssd_section(args, res, w, store, manifest, gpu_bytes, k0, v0, ceil, gather: GatherConfig) -> None:
    readers = ["posix"] + (["kvikio"] if kvikio_available() and DEV.type == "cuda" else [])
    for name in readers:
        cfg = OffloadConfig(gpu_cache_bytes=gpu_bytes, host_cache_bytes=0, reader=name, direct_io=True,
                            io_depth=args.threads, io_threads=min(args.threads, 64))
        dropped = drop_os_cache()
        fetcher = PageFetcher(store, manifest, DEV, cfg, None, gather=gather)
        with guard(res, f"ssd_{name}"):
            cold = sparse_tokens(w, fetcher, range(0, 1))
            n = args.ssd_steps if name == "posix" else max(2, args.ssd_steps // 2)
            steady = sparse_tokens(w, fetcher, range(1, 1 + n), budget_s=args.ssd_seconds)
            res[f"ssd_{name}_steps"] = len(steady)
            st = fetcher.stats
            res[f"sparse_ssd_{name}_first_ms"], res[f"sparse_ssd_{name}_ms"] = med_ms(cold), med_ms(steady)
            res[f"hit_rate_ssd_{name}"] = st.hit_rate
            res[f"ssd_{name}_read_gbps"] = st.bytes_ssd / max(st.seconds.get("ssd_read", 0.0), 1e-9) / 1e9
            res[f"ssd_{name}_pages_per_token"] = st.total.ssd_pages / st.steps
            res[f"ssd_{name}_reads_per_token"] = st.read_calls / st.steps
            res[f"ssd_{name}_verify_ms_per_token"] = st.seconds.get("verify", 0.0) * 1e3 / st.steps
            res[f"ssd_{name}_caches_dropped"] = dropped
            res[f"ssd_{name}_direct_io"] = getattr(fetcher.reader, "direct_active", None)
            res[f"max_abs_diff_ssd_{name}"] = check_equal(w, fetcher, k0, v0)
            log(f"  (ii) sparse SSD [{name}] {res[f'sparse_ssd_{name}_ms']:.1f} ms/token (first "
                f"{res[f'sparse_ssd_{name}_first_ms']:.1f}); reads {res[f'ssd_{name}_read_gbps']:.2f} GB/s; "
                f"hit {st.hit_rate:.3f}")
        fetcher.close()
        del fetcher
        gc.collect()
    per_layer, gbps = full_ssd_layer_s(w, store, manifest, min(args.ssd_full_layers, w.shape.layers))
    res["full_ssd_ms"], res["full_ssd_read_gbps"] = per_layer * w.shape.layers * 1e3, gbps
    log(f"  (b) SSD full {res['full_ssd_ms']:.0f} ms/token (from {args.ssd_full_layers} layers), read {gbps:.2f} GB/s")


# -- report --------------------------------------------------------------------------------------
def report(results: list[dict], ceil: dict) -> None:
    def f(x, p=2):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"

    print("\n| ctx | pages/head (budget) | (a) dense HBM ms | (r) sparse HBM ms | (i) sparse host ms "
          "| (b) full host ms | (i)/(a) | (b)/(i) host | hit rate | overlap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        sp = r.get("sparse_host_ms")
        print(f"| {r['ctx'] // 1024}k | {r['pages_per_head']} ({100 * r['pages_per_head'] * 16 / r['ctx']:.1f}%) | "
              f"{f(r['dense_ms'])} | {f(r['resident_sparse_ms'])} | {f(sp)} | {f(r.get('full_host_ms'), 1)} | "
              f"{f(sp / r['dense_ms'] if sp else None)} | {f(r['full_host_ms'] / sp if sp else None, 1)} | "
              f"{f(r.get('hit_rate_host'), 3)} | {f(r['overlap'], 3)} |")
    print("\n| ctx | (a) dense HBM ms | (b) full host ms | (i) fetcher ms | (r) resident ms | (r-graph) ms "
          "| (g) device-planned + CUDA graph ms | (g)/(a) | (b)/(g) | (g) hit rate | host pages/token "
          "| (g) gather GB/s (% pinned copy) | (g) eager ms | (g) torch plan, graph ms | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        g = r.get("g_triton_graph_ms", r.get("g_torch_eager_ms"))
        gb = r.get("g_gather_gbps")
        key = "g_triton_graph" if "g_triton_graph_ms" in r else "g_torch_eager"
        print(f"| {r['ctx'] // 1024}k | {f(r['dense_ms'])} | {f(r.get('full_host_ms'), 1)} "
              f"| {f(r.get('sparse_host_ms'))} | {f(r['resident_sparse_ms'])} | {f(r.get('resident_graph_ms'))} "
              f"| {f(g)} "
              f"| {f(g / r['dense_ms'] if g else None)} | {f(r['full_host_ms'] / g if g else None, 1)} "
              f"| {f(r.get(key + '_hit_rate'), 3)} | {f(r.get(key + '_host_pages_per_token'), 0)} "
              f"| {f(gb, 1)} ({f(100 * gb / ceil['h2d_gbps'] if gb else None, 0)}%) "
              f"| {f(r.get('g_triton_eager_ms'))} | {f(r.get('g_torch_graph_ms'))} | {f(r.get('g_max_abs_diff'), 4)} |")
    print("\n| ctx | (ii) sparse SSD ms (posix) | first token ms | (b) full SSD ms (scaled) | (b)/(ii) | (ii)/(a) "
          "| SSD read GB/s (% raw read) | reads/token | kvikio sparse ms | kvikio read GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        sp = r.get("sparse_ssd_posix_ms")
        rd = r.get("ssd_posix_read_gbps")
        full = r.get("full_ssd_ms")
        rd_frac = 100 * rd / ceil["disk_read_gbps"] if rd else None
        print(f"| {r['ctx'] // 1024}k | {f(sp, 1)} | {f(r.get('sparse_ssd_posix_first_ms'), 0)} | "
              f"{f(full, 0)} | {f(full / sp if sp and full else None, 1)} | "
              f"{f(sp / r['dense_ms'] if sp else None, 1)} | {f(rd)} ({f(rd_frac, 0)}%) | "
              f"{f(r.get('ssd_posix_reads_per_token'), 0)} | {f(r.get('sparse_ssd_kvikio_ms'), 1)} | "
              f"{f(r.get('ssd_kvikio_read_gbps'))} |")
    print("\n| ctx | gather GB/s, one step's pages (% pinned copy) | gather GB/s, 64k pages | breakdown ms/token "
          "(select / fetch / attend, synced) | fetch CPU ms/token (plan / sources / to_device / launch) "
          "| prefill write GB/s (% raw disk write) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        b = r.get("breakdown_host_ms", {})
        frac = 100 * r.get("gather_frac", float("nan"))
        print(f"| {r['ctx'] // 1024}k | {f(r.get('gather_gbps_step'), 1)} ({f(frac, 0)}%) "
              f"| {f(r.get('gather_gbps_big'), 1)} | {f(b.get('select'))} / {f(b.get('fetch'))} / {f(b.get('attend'))} "
              f"| {f(b.get('plan'))} / {f(b.get('sources'))} / {f(b.get('to_device'))} / {f(b.get('launch'))} "
              f"| {f(r['write_gbps'])} ({f(100 * r['write_frac'], 0)}%) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per configuration (host)")
    p.add_argument("--ssd-steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--full-reps", type=int, default=3)
    p.add_argument("--ssd-full-layers", type=int, default=4)
    p.add_argument("--ssd-seconds", type=float, default=20.0, help="time budget of steady SSD steps per reader")
    p.add_argument("--alpha", type=float, default=0.99, help="query random-walk persistence (step overlap)")
    p.add_argument("--cache-factor", type=int, default=4, help="GPU page cache = this x one step's pages")
    p.add_argument("--threads", type=int, default=16, help="SSD reads in flight (io_depth) and CRC threads")
    p.add_argument("--dir", type=Path, default=REPO / "runs" / "bench_offload")
    p.add_argument("--ceiling-bytes", type=int, default=2 << 30)
    p.add_argument("--quick", action="store_true", help="tiny shape (CPU smoke run)")
    p.add_argument("--no-ssd", action="store_true", help="skip the SSD section (host-tier rows only)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        shape = Shape(layers=2, hq=8, hkv=2, d=32, page=16, dtype=torch.float32)
        args.ctx, args.ceiling_bytes, args.steps, args.ssd_steps, args.reps = [4096], 64 << 20, 4, 2, 2
        args.ssd_full_layers, args.budget = 1, 0.05
    else:
        shape = Shape(layers=32, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16)
    args.dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    RESULTS["device"] = f"{name}, torch {torch.__version__}, kvikio {'yes' if kvikio_available() else 'no'}"
    log(RESULTS["device"])
    ceil: dict = {"h2d_gbps": h2d_ceiling(args.ceiling_bytes)}
    w_, r_, mode = disk_ceilings(args.dir / "ceiling.bin", args.ceiling_bytes)
    ceil.update(disk_write_gbps=w_, disk_read_gbps=r_, disk_read_mode=mode)
    RESULTS["ceilings"] = ceil
    log(f"ceilings: pinned H2D {ceil['h2d_gbps']:.1f} GB/s, disk write {w_:.2f} GB/s (fsync), "
        f"read {r_:.2f} GB/s ({mode})")
    results = []
    for ctx in args.ctx:
        res = run_ctx(args, shape, ctx, args.dir, ceil)
        results.append(res)
        RESULTS["ctx"][ctx] = res
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1, default=str))
        gc.collect()
    report(results, ceil)


if __name__ == "__main__":
    main()
