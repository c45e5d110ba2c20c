"""How many concurrent generations over one saved long prefix one GPU serves: sparse offloaded vs dense resident.

One ``--ctx``-token document is prefilled once into a store on local disk (random weights of Llama-3.1-8B's shape,
``--layers`` layers). Then, for each path, N = 1, 2, 4, ... ``--max-n`` generations over it are opened at once
through ``Worker.generate`` on one worker and decoded together (``--tokens`` tokens each; the engine's batch
bound raised to ``--max-n``, so every generation is in every step; one worker per path, its host tier warmed by
the first trial). The largest N that finishes is the path's capacity; the
first N that fails says why (the device out of memory, say). The paths are the product's: dense ``full`` with the
prefix's K/V resident in device memory, and Quest at ``--budget`` over the worker's pinned host tier with a device
page cache (the host tier per worker, shared by its generations: ``--host-cache-mb``; the device page cache per
generation: ``--gpu-cache-mb``). Printed per N:
peak device memory, its growth per generation over N = 1, and the median step time.

    python3 bench/bench_capacity.py --ctx 131072 --layers 32 --full-mlp --max-n 64 --json out.json
    python3 bench/bench_capacity.py --quick            # CPU smoke run (no memory limit is reached)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_engine import EngineRow, run_together  # noqa: E402
from bench.common import QUICK_SPEC, document, in_scratch_dir, llama8b_attention_spec, load_random_model  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.decode_batch import EngineConfig  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.model import LoadedModel  # noqa: E402
from workers.offload import OffloadConfig  # noqa: E402


def paths(gpu_cache_bytes: int, host_bytes: int) -> list[EngineRow]:
    """Dense resident, then Quest over the warm host tier with device-planned fetches (the product's fast path)."""
    warm = OffloadConfig(gpu_cache_bytes=gpu_cache_bytes, host_cache_bytes=host_bytes, warm_host_fraction=1.0,
                         device_plan="auto")
    return [EngineRow("full, resident (dense)", "full", None, key="dense"),
            EngineRow("quest, host warm, device-planned", "quest", warm, key="sparse")]


def device_bytes(cuda: bool) -> int:
    """Peak device memory allocated since the last reset (0 on the CPU)."""
    return torch.cuda.max_memory_allocated() if cuda else 0


def trial(worker: Worker, pid: str, path: EngineRow, n: int, budget: float, tokens: int, cuda: bool) -> dict:
    """N generations of ``path`` over ``pid`` at once: peak memory and median step, or the error that stopped
    them."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        stats, _ = run_together(worker, [pid] * n, path, budget, tokens)
    except Exception as e:  # noqa: BLE001 - the failure is the measurement: reported, then the next path runs
        return {"n": n, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "peak_bytes": device_bytes(cuda)}
    steady = [t for st in stats for t in st.step_seconds[1:]] or [0.0]
    return {"n": n, "ok": all(st.new_tokens == tokens for st in stats), "peak_bytes": device_bytes(cuda),
            "ms_per_step": 1e3 * statistics.median(steady), "seconds": time.perf_counter() - t0,
            "batch_max": max(st.extra.get("batch_max", 1.0) for st in stats)}


def measure(store: KVStore, lm: LoadedModel, pid: str, path: EngineRow, args: argparse.Namespace, cuda: bool
            ) -> dict:
    """N doubled from ``--start-n`` until a trial fails or passes ``--max-n``; then, with ``--refine``, bisected
    between the largest N that finished and the smallest that failed until they are at most ``--refine`` apart.
    One worker (its host tier warmed once) until a trial fails; a fresh one for each trial after that, so what a
    failed trial left behind cannot fail the next. Every trial, and the largest N that finished."""
    def release(held: list[Worker]) -> None:
        """Drop the live worker and what it held on the device."""
        held.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def fresh() -> Worker:
        return Worker(store, lm, progress=False, offload=path.offload, engine=EngineConfig(max_batch=args.max_n))

    held = [fresh()]  # the live worker, in a list so ``release`` drops the last reference to it
    trials: list[dict] = []
    lo, hi, n = 0, None, args.start_n
    while n <= args.max_n:
        t = trial(held[0], pid, path, n, args.budget, args.tokens, cuda)
        trials.append(t)
        shown = f"{t['peak_bytes'] / 2**30:.1f} GiB peak" + (f", {t['ms_per_step']:.1f} ms/step" if t["ok"] else "")
        print(f"  {path.name}: N={n} {'ok' if t['ok'] else 'FAILED ' + t.get('error', '')} ({shown})", flush=True)
        if t["ok"]:
            lo = n
        else:
            hi = n
        if hi is None:
            n *= 2
            continue
        if not args.refine or hi - lo <= args.refine:
            break
        n = (lo + hi) // 2
        release(held)
        held.append(fresh())
    release(held)
    return {"name": path.name, "method": path.method, "trials": trials, "capacity": lo,
            "limit_reached": hi is not None, "first_failure": hi}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--full-mlp", action="store_true", help="Llama-3.1-8B's MLP width (14336), not 4096")
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--tokens", type=int, default=8, help="tokens per generation")
    p.add_argument("--max-n", type=int, default=64, help="the most concurrent generations tried")
    p.add_argument("--start-n", type=int, default=1, help="the first N tried (then doubled)")
    p.add_argument("--refine", type=int, default=0,
                   help="after the first failure, bisect until the N that finished and the N that failed are at most "
                        "this far apart (0: stop at the first failure)")
    p.add_argument("--gpu-cache-mb", type=int, default=OffloadConfig().gpu_cache_bytes >> 20,
                   help="device page cache of each generation")
    p.add_argument("--host-cache-mb", type=int, default=20480)
    p.add_argument("--paths", default="dense,sparse", help="which paths to measure, comma-separated: dense, sparse")
    p.add_argument("--quick", action="store_true", help="tiny shape on the CPU (smoke run)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        spec = QUICK_SPEC
        args.ctx, args.tokens, args.max_n, args.gpu_cache_mb, args.host_cache_mb = 1500, 3, 2, 64, 256
        args.start_n = 1
    else:
        spec = llama8b_attention_spec(args.layers, args.ctx + 1024, intermediate_size=14336 if args.full_mlp else 4096)
    in_scratch_dir(lambda work: run(args, spec, work))


def run(args: argparse.Namespace, spec: object, work: Path) -> None:
    """Prefill the document, measure both paths and print the table."""
    cuda = torch.cuda.is_available()
    lm = load_random_model(spec, work)  # type: ignore[arg-type]
    store = KVStore(StoreConfig(home=work / "home", page_size=16))
    t0 = time.perf_counter()
    pid = Worker(store, lm, progress=False, offload=None).prefill(document(args.ctx - 1)).prefix_id
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'} ({total / 2**30:.0f} GiB); "
          f"{spec.n_layers} layers; one prefix of {args.ctx} tokens, prefill+write "  # type: ignore[attr-defined]
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    wanted = set(args.paths.split(","))
    chosen = [path for path in paths(args.gpu_cache_mb << 20, args.host_cache_mb << 20) if path.key in wanted]
    if not chosen:
        raise SystemExit(f"--paths {args.paths!r} names none of: dense, sparse")
    results = [measure(store, lm, pid, path, args, cuda) for path in chosen]
    store.close()
    print(f"\nbudget {args.budget:.0%}; {args.tokens} tokens per generation; N doubled from {args.start_n} up to "
          f"{args.max_n}" + (f", then bisected to within {args.refine}" if args.refine else "") + "\n")
    print("| path | concurrent generations | limit reached | peak GiB at that N | GiB per added generation "
          "| ms/step at that N | smallest N that failed |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ok = sorted((t for t in r["trials"] if t["ok"]), key=lambda t: t["n"])
        last = ok[-1] if ok else None
        per = ((last["peak_bytes"] - ok[0]["peak_bytes"]) / (last["n"] - ok[0]["n"]) / 2**30
               if last is not None and last["n"] > ok[0]["n"] else float("nan"))
        fail = next((f"N = {t['n']}: {t['error']}" for t in r["trials"]
                     if not t["ok"] and t["n"] == r["first_failure"]), "")
        print(f"| {r['name']} | {r['capacity']} | {'yes' if r['limit_reached'] else f'no (tried up to {args.max_n})'} "
              f"| {last['peak_bytes'] / 2**30 if last else 0:.1f} | {per:.2f} "
              f"| {last['ms_per_step'] if last else 0:.1f} | {fail} |")
    by_key = {path.key: r for path, r in zip(chosen, results)}
    if "dense" in by_key and "sparse" in by_key and by_key["dense"]["capacity"]:
        dense, sparse = by_key["dense"], by_key["sparse"]
        print(f"\nsparse serves {sparse['capacity'] / dense['capacity']:.1f}x the concurrent generations of dense"
              + ("" if sparse["limit_reached"] else " (at least: sparse did not reach its limit)"))
    if args.json:
        args.json.write_text(json.dumps({"ctx": args.ctx, "layers": spec.n_layers,  # type: ignore[attr-defined]
                                         "budget": args.budget, "paths": results}, indent=2))


if __name__ == "__main__":
    main()
