"""End-to-end decode through the product path (``Worker.generate``), offloaded vs resident, side by side.

A random-weight Llama with Llama-3.1-8B's attention shape (32 q / 8 KV heads, D=128, bf16) and a few
layers (``--layers``; the per-layer cost is what differs between rows) prefills one ``--ctx``-token
document into a store on local disk; then the same query is decoded greedily by:

- ``full, resident``: exact attention over the prefix K/V read once into HBM (dense baseline);
- ``quest, resident``: Quest at ``--budget`` over K/V held in HBM (the sparse floor, no fetch);
- ``quest, SSD cold``: pages fetched per step through the ``PageFetcher`` (GPU cache -> host tier -> SSD),
  nothing preloaded;
- ``quest, host warm, fetcher``: the prefix preloaded into the pinned host tier, fetches planned on the host;
- ``quest, host warm, device-planned``: the same, fetches planned on the GPU (``DevicePageCache``).

Per-token latency is the median step time after the query's first forward (a step ends when its
token is sampled, which syncs the device); opening the fetch path (warming the host tier) is
reported separately. The quest rows must give
identical tokens. Ratios are the result; absolute times are for reference.

    python3 bench/bench_worker_decode.py --ctx 32768 --layers 4 --json out.json
    python3 bench/bench_worker_decode.py --quick        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    QUICK_SPEC,
    document,
    drop_os_cache,
    llama8b_attention_spec,
    load_random_model,
)
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.model import LoadedModel  # noqa: E402
from workers.offload import OffloadConfig  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

QUERY = " What does the text say about the river?"


@dataclass(frozen=True)
class Row:
    name: str
    method: str
    offload: OffloadConfig | None


def rows(gpu_cache_bytes: int, host_bytes: int) -> list[Row]:
    """The configurations compared (see the module docstring)."""
    base = {"gpu_cache_bytes": gpu_cache_bytes, "host_cache_bytes": host_bytes}
    return [
        Row("full, resident (dense)", "full", None),
        Row("quest, resident", "quest", None),
        Row("quest, SSD cold (fetcher)", "quest",
            OffloadConfig(**base, warm_host_fraction=0.0, device_plan="off")),
        Row("quest, host warm, fetcher", "quest",  # the fetcher on a CPU too (not the host view)
            OffloadConfig(**base, warm_host_fraction=1.0, warm_in_background=False, device_plan="off",
                          host_in_place=False)),
        Row("quest, host warm, device-planned", "quest",
            OffloadConfig(**base, warm_host_fraction=1.0, warm_in_background=False, device_plan="auto")),
    ]


def generate(worker: Worker, pid: str, row: Row, budget: float, n: int) -> tuple[GenerationStats, float]:
    """One greedy generation of ``n`` tokens; (stats, wall seconds including opening the fetch path)."""
    st = GenerationStats()
    t0 = time.perf_counter()
    list(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=n), method=row.method, raw=True,
                         decode=DecodeConfig(budget=None if row.method == "full" else budget), stats=st))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return st, time.perf_counter() - t0


def measure(store: KVStore, lm: LoadedModel, pid: str, row: Row, budget: float, short: int, long: int) -> dict:
    """Median per-step latency after the query's forward, of one row. Each generation runs on a fresh
    worker (its own host tier), after one discarded warm-up generation (kernel compilation, allocator)."""
    cold = row.offload is not None and row.offload.warm_host_fraction == 0

    def fresh(n: int) -> tuple[GenerationStats, float]:
        if cold:
            drop_os_cache()
        return generate(Worker(store, lm, progress=False, offload=row.offload), pid, row, budget, n)

    fresh(short)
    s2, w2 = fresh(long)
    steady = s2.step_seconds[1:]  # the first step is the query's forward
    per_token = statistics.median(steady) if steady else float("nan")
    x = s2.extra
    return {"name": row.name, "method": row.method, "per_token_ms": 1e3 * per_token,
            "open_s": w2 - s2.seconds, "steps": s2.steps, "tokens": s2.token_ids,
            "read_fraction": s2.bytes_fetched / s2.bytes_full if s2.bytes_full else 0.0,
            "hit_rate": x.get("offload_hit_rate", float("nan")),
            "ssd_pages": x.get("offload_ssd_pages", 0.0), "host_pages": x.get("offload_host_pages", 0.0),
            "device_plan_pages": x.get("offload_device_plan_pages", 0.0),
            "select_s": x.get("offload_select_s", 0.0), "fetch_s": x.get("offload_fetch_s", 0.0),
            "attend_s": x.get("offload_attend_s", 0.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--short", type=int, default=2, help="tokens of the discarded warm-up generation")
    p.add_argument("--long", type=int, default=33, help="tokens of the measured generation")
    p.add_argument("--gpu-cache-mb", type=int, default=1024)
    p.add_argument("--host-cache-mb", type=int, default=8192)
    p.add_argument("--home", type=Path, default=None, help="store directory (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU (smoke run)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.quick:
        spec = QUICK_SPEC
        args.ctx, args.short, args.long = 1500, 2, 6
    else:
        spec = llama8b_attention_spec(args.layers, args.ctx + 1024)
    work = Path(tempfile.mkdtemp(prefix="kvstash-bench-"))
    lm = load_random_model(spec, work)
    store = KVStore(StoreConfig(home=args.home or work / "home", page_size=16))
    doc = document(args.ctx - 1)
    t0 = time.perf_counter()
    pre = Worker(store, lm, progress=False, offload=None).prefill(doc)
    prefill_s = time.perf_counter() - t0
    m = store.manifest(pre.prefix_id)
    kv_bytes = sum(f.size for f in m.files)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; model: {spec.n_layers} layers, 32/8 heads, "
          f"D=128; prefix {pre.n_tokens} tokens, {kv_bytes / 1e9:.2f} GB of page files; prefill+write "
          f"{prefill_s:.1f} s", flush=True)
    results = []
    for row in rows(args.gpu_cache_mb << 20, args.host_cache_mb << 20):
        r = measure(store, lm, pre.prefix_id, row, args.budget, args.short, args.long)
        results.append(r)
        print(f"  {row.name}: {r['per_token_ms']:.2f} ms/token", flush=True)
    base = results[0]["per_token_ms"]
    quest_tokens = [r["tokens"] for r in results if r["method"] == "quest"]
    same = all(t == quest_tokens[0] for t in quest_tokens)
    print(f"\nbudget {args.budget:.0%}, median over {args.long - 1} steps; quest rows give identical "
          f"tokens: {same}; OS page cache dropped before cold runs: {drop_os_cache()}\n")
    print("| path | ms/token | vs full resident | read fraction | GPU-cache hit rate | SSD pages | host pages "
          "| device-planned pages | open (warm-up) s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['per_token_ms']:.2f} | {r['per_token_ms'] / base:.2f} | {r['read_fraction']:.3f} "
              f"| {r['hit_rate']:.3f} | {r['ssd_pages']:.0f} | {r['host_pages']:.0f} | {r['device_plan_pages']:.0f} "
              f"| {r['open_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"ctx": pre.n_tokens, "layers": spec.n_layers, "budget": args.budget,
                                         "kv_bytes": kv_bytes, "prefill_s": prefill_s, "same_tokens": same,
                                         "rows": results}, indent=2))
    store.close()
    if not same:
        sys.exit("quest rows disagree: the offloaded path changed the output")


if __name__ == "__main__":
    main()
