"""Per-token decode time of every method against full attention on the CPU, through ``Worker.generate``.

The embedded CPU default is a product path (``make demo``): the shipped model (``models/kvstash-tiny``,
float32 on the CPU) prefills a generated long-context document (lab/synth, ``niah_single``) at each
``--ctx`` into a store on local disk, with the worker's default offload config (sparse methods fetch
their pages per step through the page fetcher). Then the same query is decoded greedily by every
registered method at ``--budget``, the methods interleaved round by round (``--rounds``) so a shared
machine's load hits all of them alike. Per-token time is the median step time after the query's
first forward; the table gives each method's ratio to full attention at the same length.

    python3 bench/bench_cpu_decode.py                  # 4k and 16k, every method
    python3 bench/bench_cpu_decode.py --quick          # smoke run (1k, few tokens)
    python3 bench/bench_cpu_decode.py --profile quest  # cProfile of one generation per length
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import prefilled_sample, shipped_worker  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.methods.registry import METHODS  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

TASK = "niah_single"


def run(worker: Worker, pid: str, query: str, method: str, budget: float, n: int) -> GenerationStats:
    """One greedy generation of at most ``n`` tokens (eos disabled: every method decodes ``n`` steps)."""
    st = GenerationStats()
    list(worker.generate(pid, query, SamplingParams(max_new_tokens=n), method=method, raw=True,
                         decode=DecodeConfig(budget=None if method == "full" else budget), stats=st))
    return st


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--tokens", type=int, default=12, help="decode steps per generation")
    p.add_argument("--rounds", type=int, default=2, help="generations per method (interleaved); median of all")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--offload", choices=("default", "none"), default="default",
                   help="the worker's default offload config (pages fetched per step), or none (each layer read once)")
    p.add_argument("--home", type=Path, default=None, help="store directory (reused across runs; default: temp)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1k tokens, few steps")
    p.add_argument("--profile", default=None, help="cProfile one generation of this method per length, then stop")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.ctx, args.tokens, args.rounds = [1024], 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    home = args.home or Path(tempfile.mkdtemp(prefix="kvstash-cpu-bench-"))
    worker, store = shipped_worker(home, args.offload)
    worker.lm.model.generation_config.eos_token_id = []  # decode a fixed number of steps for every method
    print(f"budget {args.budget:.0%}; {args.tokens} steps x {args.rounds} rounds per method", flush=True)
    results: dict[int, dict[str, dict]] = {}
    for n_ctx in args.ctx:
        sample, pre = prefilled_sample(worker, TASK, n_ctx)
        if args.profile:
            run(worker, pre.prefix_id, sample.query, args.profile, args.budget, 2)  # warm-up
            prof = cProfile.Profile()
            prof.enable()
            run(worker, pre.prefix_id, sample.query, args.profile, args.budget, args.tokens)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
            continue
        for m in args.methods:  # warm-up: first-use costs (kernels, allocator, artifact parsing paths)
            run(worker, pre.prefix_id, sample.query, m, args.budget, 2)
        steps: dict[str, list[float]] = {m: [] for m in args.methods}
        tokens: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for m in args.methods:
                st = run(worker, pre.prefix_id, sample.query, m, args.budget, args.tokens)
                steps[m] += st.step_seconds[1:]  # the first step is the query's forward
                tokens[m] = st.token_ids
        results[n_ctx] = {m: {"per_token_ms": 1e3 * statistics.median(steps[m]), "tokens": tokens[m]}
                          for m in args.methods}
    if args.profile:
        return
    print("\n| method | " + " | ".join(f"{c // 1024}k ms/token | {c // 1024}k vs full" for c in args.ctx) + " |")
    print("|---|" + "---|---|" * len(args.ctx))
    for m in args.methods:
        cells = []
        for c in args.ctx:
            r = results[c]
            base = r["full"]["per_token_ms"] if "full" in r else float("nan")
            cells.append(f"{r[m]['per_token_ms']:.1f} | {r[m]['per_token_ms'] / base:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"budget": args.budget, "threads": torch.get_num_threads(),
                                         "results": {str(c): r for c, r in results.items()}}, indent=2))
    store.close()


if __name__ == "__main__":
    main()
