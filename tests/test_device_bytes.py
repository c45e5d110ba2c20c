"""Device memory per generation (``workers.device_bytes``): the bytes of the tensors its own state holds.

Checked against sizes known from the layout: ``full``'s resident prefix K/V, the page fetcher's pools at a
given GPU page-cache size, a query-time cache's kept entries at a given ``budget_tokens``; Quest's page
bounds, shared by the generations over a prefix, are reported apart and never in a generation's total; the
counters reach clients through the gRPC worker server and the gateway (SSE and JSON) unchanged.
"""

from __future__ import annotations

import httpx

from client import KVClient
from store.kvstore import KVStore
from tests.gateway_harness import HEADERS, services
from workers.device_bytes import device_bytes
from workers.engine import Worker, drain_together
from workers.methods.registry import get_method
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.offload import OffloadConfig
from workers.own_kv import OwnKV
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOC = "The vault code is 7341 and the courier is Odile. " * 40
QUERY = " What is the vault code?"
PARTS = ("own_kv", "page_cache", "method")


def _prefill(worker: Worker, doc: str = DOC) -> str:
    return worker.prefill(doc).prefix_id


def _generate(worker: Worker, pid: str, method: str, decode: DecodeConfig | None = None, n_new: int = 4,
              tenant: str = "default") -> GenerationStats:
    stats = GenerationStats()
    "".join(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=n_new), method=method, decode=decode,
                            stats=stats, tenant=tenant))
    return stats


def _mem(stats: GenerationStats) -> dict[str, int]:
    return {k.removeprefix("device_bytes_") if k != "device_bytes" else "total": int(v)
            for k, v in stats.extra.items() if k.startswith("device_bytes")}


def _kv_bytes(lm: LoadedModel, tokens: int) -> int:
    """K and V of ``tokens`` prefix tokens, every layer and KV head."""
    lay = lm.layout
    return lay.n_layers * 2 * lay.n_kv_heads * tokens * lay.head_dim * lay.elem_bytes


def test_full_holds_its_prefix_kv_and_own_kv_exactly(worker: Worker, lm: LoadedModel) -> None:
    doc = "x" * (10 * lm.layout.page_size - 1)  # with BOS: whole pages, so every device holds exactly n tokens
    pid = _prefill(worker, doc)
    m = worker.store.find(pid)
    assert m is not None and m.n_tokens % lm.layout.page_size == 0
    source = PrefixSource(worker.store, m, lm.device)
    attn = get_method("full").open(source, DecodeConfig())
    own = OwnKV(lm.layout, 100, lm.device, lm.model.dtype, initial=40)
    got = device_bytes(own=own, page_cache=(None,), method=attn, device=lm.device)
    assert got.method == _kv_bytes(lm, m.n_tokens)  # layers x 2 x kv_heads x prefix_len x head_dim x dtype
    assert got.own_kv == _kv_bytes(lm, 40) == own.nbytes
    assert got.page_cache == got.shared == 0 and got.total == got.method + got.own_kv

    st = _generate(worker, pid, "full")
    mem = _mem(st)
    assert mem["total"] == sum(mem[p] for p in PARTS) == mem["end"]  # nothing it holds shrinks
    assert mem["own_kv"] == st.extra["own_kv_bytes"] > 0 and mem["page_cache"] == mem["shared"] == 0
    assert mem["method"] == _kv_bytes(lm, m.n_tokens)


def test_page_cache_bytes_follow_the_gpu_cache_size(store: KVStore, lm: LoadedModel) -> None:
    lay = lm.layout
    pages: dict[int, int] = {}
    n_pages = 0
    for slots in (8, 32):  # per layer, fewer than the prefix's pages: the budget sizes the pools
        cfg = OffloadConfig(gpu_cache_bytes=slots * lay.n_layers * lay.page_payload_bytes, device_plan="off",
                            host_in_place=False)  # the fetcher's pools (on a CPU a warm prefix is read in place)
        worker = Worker(store, lm, progress=False, offload=cfg)
        pid = _prefill(worker)
        n_pages = lay.n_pages(worker.store.find(pid).n_tokens)  # type: ignore[union-attr]
        assert slots < lay.n_kv_heads * n_pages
        pages[slots] = _mem(_generate(worker, pid, "quest", DecodeConfig(budget=0.1)))["page_cache"]
    for slots, got in pages.items():  # K and V pools of every layer, and each layer's (head, page) -> slot map
        assert got == lay.n_layers * (slots * lay.page_payload_bytes + lay.n_kv_heads * n_pages * 8)
    assert pages[32] > pages[8]


def test_a_device_planned_generation_keeps_one_page_cache(store: KVStore, lm: LoadedModel) -> None:
    """Over a warm prefix the device-planned cache serves the decode steps: the query's larger fetches go to
    one-off pools, so the generation holds that cache alone, not the fetcher's per-layer pools beside it."""
    lay = lm.layout
    slots = 64  # per layer: fewer than the prefix's pages, room for a call of a 10 % step's pages
    held = {}
    for plan in ("off", "on"):
        cfg = OffloadConfig(gpu_cache_bytes=slots * lay.n_layers * lay.page_payload_bytes, device_plan=plan,
                            host_cache_bytes=1000 * lay.page_bytes, warm_in_background=False, host_in_place=False)
        worker = Worker(store, lm, progress=False, offload=cfg)
        st = _generate(worker, _prefill(worker), "quest", DecodeConfig(budget=0.1))
        held[plan] = _mem(st)["page_cache"]
        if plan == "on":
            assert st.extra["offload_device_plan_fetches"] > 0
    pools = lay.n_layers * slots * lay.page_payload_bytes  # K and V rows of every layer's slots
    assert pools <= held["off"] and pools <= held["on"] < pools + held["off"] // 2  # one set of pools, not two


def test_query_time_cache_peaks_at_the_whole_prefix_and_ends_at_its_budget(worker: Worker, lm: LoadedModel) -> None:
    pid = _prefill(worker)
    n = worker.store.find(pid).n_tokens  # type: ignore[union-attr]
    mems = {b: _mem(_generate(worker, pid, "snapkv", DecodeConfig(budget_tokens=b))) for b in (32, 128)}
    for mem in mems.values():
        assert mem["total"] > _kv_bytes(lm, n)  # the query read every layer whole: held until it was in
        assert mem["end"] < mem["total"]
    lay = lm.layout
    kept_ids = lay.n_layers * lay.n_kv_heads * 8  # int64 per kept entry
    assert mems[128]["end"] - mems[32]["end"] == 96 * (_kv_bytes(lm, 1) + kept_ids)


def test_shared_quest_bounds_are_counted_apart_and_once(store: KVStore, lm: LoadedModel) -> None:
    # every generation opens over a warm prefix: its steps use the same page cache (none, on a CPU)
    worker = Worker(store, lm, progress=False, offload=OffloadConfig(warm_in_background=False))
    pid = _prefill(worker)
    lay = lm.layout
    n_pages = lay.n_pages(worker.store.find(pid).n_tokens)  # type: ignore[union-attr]
    bounds = lay.n_layers * lay.n_kv_heads * 2 * lay.head_dim * n_pages * lay.elem_bytes  # kmax over kmin
    alone = _mem(_generate(worker, pid, "quest", DecodeConfig(budget=0.2)))
    stats = [GenerationStats() for _ in range(2)]
    drain_together([worker.generate(pid, QUERY, SamplingParams(max_new_tokens=4), method="quest",
                                    decode=DecodeConfig(budget=0.2), stats=s) for s in stats])
    together = [_mem(s) for s in stats]
    assert alone["shared"] == bounds  # streamed in: only the stacked bounds stay on the device
    assert alone["method"] < bounds  # the bounds are in no generation's own count
    for mem in together:  # sharing the bounds with another generation changes nobody's count
        assert mem == alone


def test_device_bytes_reach_clients_through_grpc_and_the_gateway(worker: Worker) -> None:
    with services(worker) as svc:
        via_grpc = KVClient(f"grpc://{svc.worker_addr}", api_key="key-a")
        via_gateway = KVClient(svc.url, api_key="key-a")
        pid = via_grpc.prefill(DOC).prefix_id
        local = _mem(_generate(worker, pid, "full", tenant="a"))
        assert local["total"] > 0
        for client in (via_grpc, via_gateway):
            gen = client.generate(QUERY, prefix=pid, max_new_tokens=4, method="full")
            assert gen.text is not None
            assert _mem(gen.stats) == local
        r = httpx.post(f"{svc.url}/v1/prefixes/{pid}/generate", headers=HEADERS["a"], timeout=60,
                       json={"query": QUERY, "max_new_tokens": 4, "method": "full"})  # the REST body, not streamed
        assert r.status_code == 200, r.text
        assert _mem(GenerationStats.from_json(r.json()["stats"])) == local
