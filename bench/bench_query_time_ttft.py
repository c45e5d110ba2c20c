"""Time to first token of the query-time caches (SnapKV, LookaheadKV) against full attention (issue #16).

Through ``Worker.generate`` on the shipped model (``models/kvstash-tiny`` with its trained
``lookahead.safetensors``; ``--device``, ``--dtype``: bf16 on CUDA, float32 on the CPU by default): a
generated long-context document (lab/synth, ``niah_single``) is prefilled at each ``--ctx``, then the
same question is asked with ``max_new_tokens=1`` by each method, the methods interleaved round by round
(``--rounds``) so a shared machine's load hits them alike. TTFT is the wall time of that whole one-token
generation (open, the query's forward, the keep-set scoring pass, the first sample, close; on CUDA the
device is synchronized before each clock read); the table gives the median and its ratio to full at the
same length.

The shipped model's context is 32768 positions (``max_position_embeddings``, which the worker enforces:
document + query must leave room for one new token), so a ``--ctx`` at or above it is run at
``max_context - 1`` prompt tokens (document + query) and says so; it is still labelled 32k.

With the worker's default offload config the query-time caches read the prefix through the tiers:
after the warm-up question the prefix is hot in the pinned host tier (``host pages`` vs ``ssd pages``
of the last round say where the reads came from). ``--offload none``: each layer read from the page
files at every question.

    python3 bench/bench_query_time_ttft.py                 # 4k and 8k (cuda when available)
    python3 bench/bench_query_time_ttft.py --ctx 32768     # the issue's target, on the GPU
    python3 bench/bench_query_time_ttft.py --quick         # CPU smoke run (1k, one round)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_device_args, device_and_dtype, prefilled_sample, shipped_worker, sync  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.model_source import SHIPPED_MODEL_NAME  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

TASK = "niah_single"
METHODS = ("full", "snapkv", "lookahead")


def first_token(worker: Worker, pid: str, query: str, method: str, budget_tokens: int) -> tuple[float, GenerationStats]:
    """Seconds of a one-token generation, and its stats."""
    st = GenerationStats()
    decode = DecodeConfig(budget_tokens=None if method == "full" else budget_tokens)
    sync(worker.lm.device)
    t0 = time.perf_counter()
    list(worker.generate(pid, query, SamplingParams(max_new_tokens=1), method=method, raw=True, decode=decode,
                         stats=st))
    sync(worker.lm.device)
    return time.perf_counter() - t0, st


def write_profile(path: Path, run: Callable[[], object]) -> None:
    """Profile one call of ``run`` and write its op table (by device time, then by host time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        run()
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    by_device = table.table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total", row_limit=40)
    path.write_text(by_device + "\n\n" + table.table(sort_by="cpu_time_total", row_limit=40))


def label(n_ctx: int) -> str:
    """``4k``, ``32k`` (32767 tokens too)."""
    return f"{round(n_ctx / 1024)}k"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--budget-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="questions per method (interleaved); median of all")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--offload", choices=("default", "none"), default="default",
                   help="the worker's default offload config (whole-layer reads through the tiers), or none")
    p.add_argument("--home", type=Path, default=None, help="store directory (reused across runs; default: temp)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1k tokens, one round, cpu unless --device")
    add_device_args(p)
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", type=Path, default=None,
                   help="after the timed rounds, one more question per method under torch.profiler: op tables here")
    args = p.parse_args()
    if args.quick:
        args.ctx, args.rounds, args.device = [1024], 1, args.device or "cpu"
    device, dtype = device_and_dtype(args.device, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    home = args.home or Path(tempfile.mkdtemp(prefix="kvstash-ttft-bench-"))
    worker, store = shipped_worker(home, args.offload, device=device, dtype=dtype)
    if "lookahead" in args.methods and worker.lm.lookahead is None:
        raise SystemExit(f"{SHIPPED_MODEL_NAME} has no lookahead.safetensors: leave out --methods lookahead")
    print(f"budget {args.budget_tokens} tokens; {args.rounds} rounds", flush=True)
    results: dict[int, dict[str, dict]] = {}
    cap = worker.lm.max_context - 1  # the worker refuses a prompt that leaves no room for the first token
    for c in args.ctx:
        if c > cap:
            print(f"[{c}] the model's context is {worker.lm.max_context}: run at {cap} prompt tokens", flush=True)
    args.ctx = [min(c, cap) for c in args.ctx]
    for n_ctx in args.ctx:
        sample, pre = prefilled_sample(worker, TASK, n_ctx)
        for m in args.methods:  # warm-up: first-use costs, and the prefix hot in the host tier
            first_token(worker, pre.prefix_id, sample.query, m, args.budget_tokens)
        times: dict[str, list[float]] = {m: [] for m in args.methods}
        last: dict[str, GenerationStats] = {}
        for _ in range(args.rounds):
            for m in args.methods:
                s, last[m] = first_token(worker, pre.prefix_id, sample.query, m, args.budget_tokens)
                times[m].append(s)
                print(f"[{n_ctx}] {m}: {1e3 * s:.1f} ms", flush=True)
        results[n_ctx] = {m: {"ttft_ms": 1e3 * statistics.median(times[m]), "all_ms": [1e3 * t for t in times[m]],
                              "host_pages": last[m].extra.get("offload_host_pages", 0.0),
                              "ssd_pages": last[m].extra.get("offload_ssd_pages", 0.0),
                              "token": last[m].token_ids} for m in args.methods}
        if args.profile:
            for m in args.methods:
                ask = functools.partial(first_token, worker, pre.prefix_id, sample.query, m, args.budget_tokens)
                write_profile(args.profile / f"profile_{label(n_ctx)}_{m}.txt", ask)
        if args.json:  # after each length: a run killed later keeps what it measured
            args.json.write_text(json.dumps({"device": str(device), "dtype": dtype,
                                             "max_context": worker.lm.max_context, "budget_tokens": args.budget_tokens,
                                             "threads": torch.get_num_threads(), "offload": args.offload,
                                             "results": {str(c): r for c, r in results.items()}}, indent=2))
    print("\n| method | " + " | ".join(f"{label(c)} TTFT ms | {label(c)} vs full | {label(c)} host/ssd pages"
                                      for c in args.ctx) + " |")
    print("|---|" + "---|---|---|" * len(args.ctx))
    for m in args.methods:
        cells = []
        for c in args.ctx:
            r = results[c]
            base = r["full"]["ttft_ms"] if "full" in r else float("nan")
            cells.append(f"{r[m]['ttft_ms']:.1f} | {r[m]['ttft_ms'] / base:.2f} | "
                         f"{r[m]['host_pages']:.0f}/{r[m]['ssd_pages']:.0f}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    store.close()


if __name__ == "__main__":
    main()
