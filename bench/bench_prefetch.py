"""Layer-ahead prefetch on the CPU: how well layer l+1's pages are predicted at layer l, and how many SSD
page reads the prefetch moves off the real fetches.

The shipped model (``models/kvstash-tiny``, 8 layers, loaded through ``workers.model.load_model``)
prefills ``--docs`` synthetic documents of ``--length`` tokens (``lab.synth``, eval split) into a
store on local disk. Each document's question is decoded greedily by every sparse method at
``--budget``, once per ``OffloadConfig.prefetch`` (off, same_pages, speculative), each run on a fresh
worker (its own host tier) and cold: nothing preloaded (``warm_host_fraction=0``), a host tier of
``--host-fraction`` of the prefix and a GPU page cache of ``--gpu-slots`` pages per layer.

Per (method, predictor), summed over documents and forwards (the query's forward included):
recall / precision of the predicted next-layer pages against the selection that layer then really made
(mid-region (KV head, page) pairs), pages prefetched, useful (asked for by a real fetch, found in the host
tier), SSD pages the real fetches still read, moved = useful / (useful + SSD pages of the real fetches),
and ms/token (wall, this CPU). Outputs must equal the prefetch-off run's.

    python3 bench/bench_prefetch.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.synth import SynthContext, generate  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.methods.registry import METHODS  # noqa: E402
from workers.model import LoadedModel, load_model  # noqa: E402
from workers.offload import OffloadConfig  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

MODES = ("off", "same_pages", "speculative")
COUNTERS = ("prefetch_predicted_pages", "prefetch_selected_pages", "prefetch_matched_pages", "prefetch_pages",
            "prefetch_useful", "prefetch_waits", "prefetch_wait_s", "prefetch_dropped", "prefetch_read_s", "ssd_pages",
            "host_pages", "gpu_hits", "fetch_s", "ssd_read_s", "verify_s", "speculate_s", "select_s", "attend_s")


def run(store: KVStore, lm: LoadedModel, pid: str, query: str, method: str, cfg: OffloadConfig, budget: float,
        new_tokens: int) -> tuple[GenerationStats, float]:
    st = GenerationStats()
    t0 = time.perf_counter()
    list(Worker(store, lm, progress=False, offload=cfg).generate(
        pid, query, SamplingParams(max_new_tokens=new_tokens), method=method, decode=DecodeConfig(budget=budget),
        stats=st, raw=True))
    return st, time.perf_counter() - t0


def summarize(method: str, mode: str, acc: dict[str, float]) -> dict[str, float | str]:
    """Ratios of one (method, predictor) from its summed counters."""
    real_ssd, useful = acc["ssd_pages"], acc["prefetch_useful"]
    return {"method": method, "predictor": mode, **acc,
            "recall": acc["prefetch_matched_pages"] / max(1.0, acc["prefetch_selected_pages"]),
            "precision": acc["prefetch_matched_pages"] / max(1.0, acc["prefetch_predicted_pages"]),
            "moved": useful / max(1.0, useful + real_ssd),
            "wasted": (acc["prefetch_pages"] - useful) / max(1.0, acc["prefetch_pages"]),
            **{f"{k}_ms_per_token": 1e3 * acc[k] / max(1.0, acc["tokens"])
               for k in ("seconds", "fetch_s", "speculate_s", "prefetch_read_s", "select_s", "attend_s")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "kvstash-tiny"))
    p.add_argument("--task", default="niah_single")
    p.add_argument("--length", type=int, default=6144)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--host-fraction", type=float, default=0.25, help="host tier size / prefix size")
    p.add_argument("--gpu-slots", type=int, default=192, help="GPU page-cache pages per layer")
    p.add_argument("--methods", nargs="*", default=sorted(m for m in METHODS if m != "full"))
    p.add_argument("--no-warmup", action="store_true", help="skip the discarded short generation per method")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lm = load_model(args.model, page_size=16, progress=False)
    lay = lm.layout
    store = KVStore(StoreConfig(home=Path(tempfile.mkdtemp(prefix="kvstash-prefetch-")), page_size=16))
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    docs = []
    for i in range(args.docs):
        sample = generate(args.task, args.length, 100_000 + i, ctx)
        pre = Worker(store, lm, progress=False, offload=None).prefill(sample.document)
        docs.append((pre.prefix_id, pre.n_tokens, sample.query))
    print(f"model {args.model} ({lay.n_layers} layers, {lay.n_kv_heads} KV heads, fingerprint {lm.fingerprint[:12]}); "
          f"{args.docs} x {args.task} docs of {[n for _, n, _ in docs]} tokens; budget {args.budget}", flush=True)
    rows, all_same = [], True
    for method in args.methods:
        if not args.no_warmup:  # allocator, lazily built state, OS page cache: not charged to the first row
            run(store, lm, docs[0][0], docs[0][2], method, OffloadConfig(), args.budget, 2)
        ref: dict[str, list[int]] = {}
        for mode in MODES:
            acc = dict.fromkeys((*COUNTERS, "seconds", "tokens"), 0.0)
            for pid, n_tokens, query in docs:
                prefix_pages = lay.n_layers * lay.n_kv_heads * lay.n_pages(n_tokens)
                cfg = OffloadConfig(gpu_cache_bytes=args.gpu_slots * lay.n_layers * lay.page_payload_bytes,
                                    host_cache_bytes=int(args.host_fraction * prefix_pages) * lay.page_bytes,
                                    warm_host_fraction=0, device_plan="off", io_threads=2, prefetch=mode)
                st, wall = run(store, lm, pid, query, method, cfg, args.budget, args.new_tokens)
                ref.setdefault(pid, st.token_ids)
                all_same &= ref[pid] == st.token_ids
                for k in COUNTERS:
                    acc[k] += st.extra.get(f"offload_{k}", 0.0)
                acc["seconds"] += wall
                acc["tokens"] += st.steps
            rows.append(summarize(method, mode, acc))
            r = rows[-1]
            print(f"  {method:12s} {mode:12s} recall {r['recall']:.3f} precision {r['precision']:.3f} "
                  f"moved {r['moved']:.3f} real SSD pages {r['ssd_pages']:.0f} useful {r['prefetch_useful']:.0f} "
                  f"prefetched {r['prefetch_pages']:.0f} {r['seconds_ms_per_token']:.0f} ms/token "
                  f"(fetch {r['fetch_s_ms_per_token']:.0f}, speculate {r['speculate_s_ms_per_token']:.0f})", flush=True)
    print(f"\noutputs equal to prefetch off: {all_same}\n")
    print("| method | predictor | recall | precision | pages prefetched | useful | real-fetch SSD pages "
          "(off: all) | moved off the critical path | ms/token | of which fetch | of which speculate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k: str, spec: str, r: dict = r) -> str:
            return format(r[k], spec) if r["predictor"] != "off" else "–"

        print(f"| {r['method']} | {r['predictor']} | {f('recall', '.3f')} | {f('precision', '.3f')} "
              f"| {f('prefetch_pages', '.0f')} | {f('prefetch_useful', '.0f')} | {r['ssd_pages']:.0f} "
              f"| {f('moved', '.3f')} | {r['seconds_ms_per_token']:.0f} | {r['fetch_s_ms_per_token']:.0f} "
              f"| {r['speculate_s_ms_per_token']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "same": all_same,
                                         "docs": [n for _, n, _ in docs], "rows": rows}, indent=2))
    store.close()
    if not all_same:
        sys.exit("prefetch changed an output")


if __name__ == "__main__":
    main()
