"""The product's decode engine at batch 1 and batch B: sparse offloaded vs dense resident, side by side.

A random-weight Llama with Llama-3.1-8B's attention shape (32 q / 8 KV heads, D=128, bf16 on CUDA)
and ``--layers`` layers prefills ``--batch`` different ``--ctx``-token documents into a store on local
disk. Then, through ``Worker.generate`` (the engine every interface uses), each row decodes greedily
one generation alone and ``--batch`` generations at once (one per document, all in the engine's
steps):

- ``full, resident``: exact attention over each prefix's K/V read once into device memory (dense);
- ``quest, host warm, device-planned``: Quest at ``--budget``, pages fetched per step from the pinned
  host tier (the prefix warmed when the generation opens), fetches planned on the device; each layer's
  select + fetch + attend replayed from a CUDA graph, and the same eager; ``one stream``: the whole-step
  graph with every generation's attention on the step's stream (``EngineConfig.member_streams=1``);
  ``tokens to the host before the next launch``: each step's tokens read before the next step is launched
  (``EngineConfig.step_ahead=False``, also for dense: ``dense-sync``);
- ``quest, SSD cold``: the same with nothing warm: pages from the page files per step.

Printed: per-generation ms per token (median step after the query's forward), decode tokens per
second of the batch (batch / median step), tokens per second over the whole batch's wall time
(opening included), and each row's ratio to the dense row at the same batch size; and whether the
first generation's tokens are the same alone and batched (on the CPU they must be; bf16 GEMMs of
another batch size round differently, so on a GPU a random-weight model's near-ties can flip).

    python3 bench/bench_engine.py --ctx 32768 --layers 8 --batch 8 --json out.json
    python3 bench/bench_engine.py --quick            # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_worker_decode import Row  # noqa: E402
from bench.common import (  # noqa: E402
    QUICK_SPEC,
    document,
    drop_os_cache,
    in_scratch_dir,
    llama8b_attention_spec,
    load_random_model,
)
from lab.tiny_random import TinyLlamaSpec  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.decode_batch import EngineConfig  # noqa: E402
from workers.engine import GenerationStream, Worker, close_streams, drain_together  # noqa: E402
from workers.model import LoadedModel  # noqa: E402
from workers.model_ops import use_fused_ops, use_plain_ops  # noqa: E402
from workers.offload import OffloadConfig  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

QUERY = " What does the text say about the river?"
PROFILE_SKIP = 4
"""Decode steps run before the profiler starts: the query's forward, the first eager step and the capture."""


@dataclass(frozen=True)
class EngineRow(Row):
    key: str = ""
    """Short name for ``--rows``."""
    graphs: bool = True
    """``EngineConfig.cuda_graphs``: fixed-shape prefix steps replayed from CUDA graphs."""
    whole_step: str = "auto"
    """``EngineConfig.whole_step``: a stable batch's whole decode step in one CUDA graph (``off``: per-layer
    graphs of the prefix steps only)."""
    member_streams: int = EngineConfig().member_streams
    """``EngineConfig.member_streams``: side streams a whole step spreads its generations' attention over."""
    step_ahead: bool = EngineConfig().step_ahead
    """``EngineConfig.step_ahead``: a stable batch's next step launched before its tokens reach the host."""
    temperature: float = 0.0
    """0: greedy; else tokens sampled at this temperature (top-p ``SAMPLED_TOP_P``, a seed per generation)."""


SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95
"""The sampled rows' settings (a chat-like default)."""


def rows(gpu_cache_bytes: int, host_bytes: int) -> list[EngineRow]:
    """The configurations compared (see the module docstring); the first is the dense baseline."""
    base = {"gpu_cache_bytes": gpu_cache_bytes, "host_cache_bytes": host_bytes}
    warm = OffloadConfig(**base, warm_host_fraction=1.0, device_plan="auto")
    return [
        EngineRow("full, resident (dense, flash), whole-step CUDA graph", "full", None, key="dense"),
        EngineRow("full, resident (dense, flash), eager", "full", None, key="dense-eager", graphs=False),
        EngineRow("full, resident (dense, flash), whole-step CUDA graph, tokens to the host before the next launch",
                  "full", None, key="dense-sync", step_ahead=False),
        EngineRow("quest, host warm, device-planned, whole-step CUDA graph", "quest", warm, key="graphs"),
        EngineRow("quest, host warm, device-planned, whole-step CUDA graph, tokens to the host before the next "
                  "launch", "quest", warm, key="graphs-sync", step_ahead=False),
        EngineRow(f"full, resident (dense, flash), whole-step CUDA graph, sampled (T={SAMPLED_TEMPERATURE}, "
                  f"top-p {SAMPLED_TOP_P})", "full", None, key="dense-sampled", temperature=SAMPLED_TEMPERATURE),
        EngineRow(f"quest, host warm, device-planned, whole-step CUDA graph, sampled (T={SAMPLED_TEMPERATURE}, "
                  f"top-p {SAMPLED_TOP_P})", "quest", warm, key="graphs-sampled", temperature=SAMPLED_TEMPERATURE),
        EngineRow("quest, host warm, device-planned, whole-step CUDA graph, one stream", "quest", warm,
                  key="graphs-1stream", member_streams=1),
        EngineRow("quest, host warm, device-planned, per-layer graphs", "quest", warm, key="layer-graphs",
                  whole_step="off"),
        EngineRow("quest, host warm, device-planned, eager", "quest", warm, key="eager", graphs=False),
        EngineRow("quest, SSD cold (fetcher)", "quest", OffloadConfig(**base, warm_host_fraction=0.0,
                                                                      device_plan="off"), key="cold"),
    ]


def row_worker(store: KVStore, lm: LoadedModel, row: EngineRow) -> Worker:
    """A fresh worker with the row's offload and engine configuration."""
    engine = EngineConfig(cuda_graphs=row.graphs, whole_step=row.whole_step,  # type: ignore[arg-type]
                          member_streams=row.member_streams, step_ahead=row.step_ahead)
    return Worker(store, lm, progress=False, offload=row.offload, engine=engine)


def row_stream(worker: Worker, pid: str, row: EngineRow, budget: float, n: int,
               stats: GenerationStats, seed: int = 0) -> GenerationStream:
    """One generation of ``row``'s method over ``pid`` (``n`` tokens, ``budget`` unless dense; ``seed`` for a
    sampled row)."""
    decode = DecodeConfig(budget=None if row.method == "full" else budget)
    params = (SamplingParams(max_new_tokens=n, temperature=row.temperature, top_p=SAMPLED_TOP_P, seed=seed)
              if row.temperature else SamplingParams(max_new_tokens=n))
    return worker.generate(pid, QUERY, params, method=row.method, raw=True, decode=decode, stats=stats)


def run_together(worker: Worker, pids: list[str], row: EngineRow, budget: float,
                 n: int) -> tuple[list[GenerationStats], float]:
    """Generations over ``pids`` at once (one thread pulls each in turn: every step serves all);
    returns their stats and the wall seconds of the whole batch."""
    stats = [GenerationStats() for _ in pids]
    t0 = time.perf_counter()
    live: list[GenerationStream] = []
    try:
        for i, (pid, st) in enumerate(zip(pids, stats, strict=True)):
            live.append(row_stream(worker, pid, row, budget, n, st, seed=i))
    except BaseException:  # an open that failed (out of device memory, say): the opened ones end now
        close_streams(live)
        raise
    drain_together(live)  # a failed batch closes what it opened before the error reaches the caller
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return stats, time.perf_counter() - t0


def measure(store: KVStore, lm: LoadedModel, pids: list[str], row: EngineRow, budget: float, n: int) -> dict:
    """One row at batch 1 and at ``len(pids)``: ms per token and tokens per second (fresh worker each)."""
    cold = row.offload is not None and row.offload.warm_host_fraction == 0
    out: dict = {"name": row.name, "method": row.method}
    for label, group in (("b1", pids[:1]), ("bn", pids)) if len(pids) > 1 else (("b1", pids),):
        if cold:
            drop_os_cache()
        worker = row_worker(store, lm, row)
        run_together(worker, group[:1], row, budget, 2)  # warm-up: kernels, allocator
        stats, wall = run_together(worker, group, row, budget, n)
        steady = [t for st in stats for t in st.step_seconds[1:]]
        graphs = worker.engine._graphs
        replays = graphs.replays if graphs is not None else 0
        ahead = worker.engine.ahead_steps
        del worker  # its pinned host tier goes before the next worker pins one
        gc.collect()
        out[label] = {"ms_per_token": 1e3 * statistics.median(steady),
                      "tokens_per_s": sum(st.new_tokens for st in stats) / wall,
                      "decode_tokens_per_s": len(group) / statistics.median(steady),
                      "batch_max": max(st.extra.get("batch_max", 1.0) for st in stats),
                      "read_fraction": sum(st.bytes_fetched for st in stats)
                      / max(1, sum(st.bytes_full for st in stats)),
                      "whole_step_replays": replays, "ahead_steps": ahead,
                      "tokens": [st.token_ids for st in stats]}
    out.setdefault("bn", out["b1"])
    out["same_tokens"] = out["bn"]["tokens"][0] == out["b1"]["tokens"][0]
    return out


def profile_row(store: KVStore, lm: LoadedModel, pids: list[str], row: EngineRow, budget: float, n: int,
                trace: Path | None = None) -> None:
    """Print the GPU kernels of the steady decode steps of generations over ``pids`` run together (after each
    one's query forward, first eager step and capture), by total time per step."""
    from torch.profiler import ProfilerActivity, profile

    worker = row_worker(store, lm, row)
    run_together(worker, pids, row, budget, n)  # warm: kernels compiled, allocator grown, groups captured
    stats = [GenerationStats() for _ in pids]
    gens = [row_stream(worker, pid, row, budget, n, st) for pid, st in zip(pids, stats, strict=True)]
    while any(st.steps < PROFILE_SKIP for st in stats):  # the query's forward, the first eager step, the capture
        for g in gens:
            next(g, None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    first = stats[0].steps
    with profile(activities=acts) as prof:
        live = list(gens)
        while live:
            for g in list(live):
                if next(g, None) is None:
                    live.remove(g)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    steps = max(1, stats[0].steps - first)
    if trace is not None:  # the timeline (chrome://tracing, Perfetto): where a step's kernels overlap or wait
        prof.export_chrome_trace(str(trace))
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.self_device_time_total for e in events)
    print(f"  profile of {row.name}, batch {len(pids)}: {steps} steady steps, GPU {total / steps / 1e3:.3f} ms per "
          "step (self time)", flush=True)
    for e in events[:30]:
        print(f"    {e.self_device_time_total / steps / 1e3:8.4f} ms/step  {e.count / steps:6.1f}/step  {e.key[:90]}",
              flush=True)
    del worker, gens
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--tokens", type=int, default=33, help="tokens per generation")
    p.add_argument("--gpu-cache-mb", type=int, default=4096)
    p.add_argument("--host-cache-mb", type=int, default=32768)
    p.add_argument("--home", type=Path, default=None, help="store directory (default: a temp dir)")
    p.add_argument("--full-mlp", action="store_true", help="Llama-3.1-8B's MLP width (14336) too, not 4096")
    p.add_argument("--rows", default="dense,graphs,eager,cold",
                   help="comma-separated rows to run (dense always runs: the ratios are to it)")
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU (smoke run)")
    p.add_argument("--profile", default="", help="comma-separated rows to profile after measuring: GPU kernel time "
                                                 "per step by kernel (one more batch-1 generation under the profiler)")
    p.add_argument("--profile-batch", type=int, default=1, help="generations run together under the profiler")
    p.add_argument("--trace", type=Path, help="write the profiled steps' timeline here (Chrome trace JSON)")
    p.add_argument("--fused-ops", choices=("off", "on", "both"), default="on",
                   help="the model's RoPE and RMSNorm through the fused launchers (both: every row twice)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        spec = QUICK_SPEC
        args.ctx, args.tokens, args.batch = 1500, 6, 3
        args.gpu_cache_mb, args.host_cache_mb = 64, 256
    else:
        spec = llama8b_attention_spec(args.layers, args.ctx + 1024, intermediate_size=14336 if args.full_mlp else 4096)
    in_scratch_dir(lambda work: run(args, spec, work))


def run(args: argparse.Namespace, spec: TinyLlamaSpec, work: Path) -> None:
    """Prefill the documents, measure the wanted rows and print the table."""
    cuda = torch.cuda.is_available()
    lm = load_random_model(spec, work)
    store = KVStore(StoreConfig(home=args.home or work / "home", page_size=16))
    writer = Worker(store, lm, progress=False, offload=None)
    t0 = time.perf_counter()
    pids = [writer.prefill(document(args.ctx - 1, seed)).prefix_id for seed in range(args.batch)]
    prefill_s = (time.perf_counter() - t0) / args.batch
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; model: {spec.n_layers} layers, "
          f"{spec.n_heads}/{spec.n_kv_heads} heads; {args.batch} prefixes of {args.ctx} tokens; prefill+write "
          f"{prefill_s:.1f} s each", flush=True)
    results = []
    wanted = {"dense", *args.rows.split(",")}
    ops_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.fused_ops]
    for fused, row in ((f, r) for f in ops_modes for r in rows(args.gpu_cache_mb << 20, args.host_cache_mb << 20)):
        if row.key not in wanted:
            continue
        if fused:
            use_fused_ops(lm.model)
            row = replace(row, name=row.name + " + fused ops")
        else:
            use_plain_ops(lm.model)
        r = measure(store, lm, pids, row, args.budget, args.tokens)
        r["fused_ops"] = fused
        results.append(r)
        print(f"  {row.name}: batch 1 {r['b1']['ms_per_token']:.2f} ms/token; batch {args.batch} "
              f"{r['bn']['tokens_per_s']:.1f} tokens/s; whole-step replays {r['b1']['whole_step_replays']}/"
              f"{r['bn']['whole_step_replays']}; steps launched ahead {r['b1']['ahead_steps']}/"
              f"{r['bn']['ahead_steps']}", flush=True)
        if row.key in args.profile.split(","):
            profile_row(store, lm, pids[:args.profile_batch], row, args.budget, args.tokens, args.trace)
        if args.json:  # after every row: a run stopped at its time limit keeps what it measured
            args.json.write_text(json.dumps({"ctx": args.ctx, "layers": spec.n_layers, "batch": args.batch,
                                             "budget": args.budget, "prefill_s": prefill_s, "rows": results}))
    print(f"\nbudget {args.budget:.0%}; median step after each query's forward; {args.tokens} tokens per generation\n")
    print(f"| path | batch 1 ms/token | vs dense | batch {args.batch} ms/step | decode tokens/s | vs dense "
          "| tokens/s with opening | vs dense | read fraction | same tokens batched |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:  # each row's ratio is to the dense row with the same model ops
        b1, bn = r["b1"], r["bn"]
        base = next(x for x in results if x["fused_ops"] == r["fused_ops"])
        d1, dn = base["b1"], base["bn"]
        print(f"| {r['name']} | {b1['ms_per_token']:.2f} | {b1['ms_per_token'] / d1['ms_per_token']:.2f} "
              f"| {bn['ms_per_token']:.2f} | {bn['decode_tokens_per_s']:.1f} "
              f"| {bn['decode_tokens_per_s'] / dn['decode_tokens_per_s']:.2f} | {bn['tokens_per_s']:.1f} "
              f"| {bn['tokens_per_s'] / dn['tokens_per_s']:.2f} | {bn['read_fraction']:.3f} | {r['same_tokens']} |")
    if args.json:
        args.json.write_text(json.dumps({"ctx": args.ctx, "layers": spec.n_layers, "batch": args.batch,
                                         "budget": args.budget, "prefill_s": prefill_s, "rows": results}, indent=2))
    store.close()
    if not cuda and not all(r["same_tokens"] for r in results):
        sys.exit("batched tokens differ from the same generation alone")


if __name__ == "__main__":
    main()
