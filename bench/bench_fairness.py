"""Two tenants, one worker: tenant B's latency for short requests, alone and while tenant A floods.

The product's worker server (its fair scheduler: one decode step per turn, round-robin across
tenants, bounded admission) serves a tiny random Llama on loopback gRPC; the model never ends an
answer early (no EOS), so every request runs to its max_new_tokens. Tenant B sends ``--b-requests``
short generations (``--b-tokens`` each) one after another from its own process, first alone, then while
tenant A keeps ``--a-streams`` max-length generations (``--a-tokens`` each, the worker's cap) going at
once from a third process (each tenant is a client elsewhere, as in production: a client's threads take
no share of the server's interpreter lock, so B's latency is the server's doing, not its own client's);
an A request the worker refuses (over A's ``--max-per-tenant``) waits the retry-after hint and retries.
Printed side by side: B's p50 and p95 latency unloaded and loaded, and the ratio (the target is
p95 loaded <= 2x p95 unloaded), with A's token rate while it floods.

    python3 bench/bench_fairness.py --json out.json
    python3 bench/bench_fairness.py --quick            # smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import llama8b_attention_spec  # noqa: E402
from lab.tiny_random import TinyLlamaSpec, build_tiny_llama  # noqa: E402
from services.auth import ApiKeys  # noqa: E402
from services.convert import retry_after_of  # noqa: E402
from services.gen import kvstash_pb2 as pb  # noqa: E402
from services.gen import kvstash_pb2_grpc as pb_grpc  # noqa: E402
from services.grpc_common import ServerConfig, channel  # noqa: E402
from services.scheduler import SchedulerConfig  # noqa: E402
from services.worker_server import WorkerLimits, build_worker_server  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.model import load_model  # noqa: E402

KEYS = ApiKeys({"key-a": "a", "key-b": "b"})
MD = {"a": [("x-api-key", "key-a")], "b": [("x-api-key", "key-b")]}
DOC = "The river runs past the mill, the bridge and the old customs house before it reaches the sea. " * 8


ENGINE_FIGURES = ("ttft_s", "ms_per_token", "batch_mean", "graph_steps")
"""What the worker's done event says of each B generation (its engine-side time, batch and captured steps)."""


def generate(stub: pb_grpc.WorkerStub, tenant: str, pid: str, tokens: int) -> dict[str, float]:
    """One generation, to its end; its ``ENGINE_FIGURES``."""
    events = list(stub.Generate(pb.GenerateRequest(prefix_id=pid, query=" Where does the river go?",
                                                   max_new_tokens=tokens), metadata=MD[tenant], timeout=3600))
    extra = events[-1].done.extra
    return {k: float(extra[k]) for k in ENGINE_FIGURES if k in extra}


def b_latencies(stub: pb_grpc.WorkerStub, pid: str, n: int, tokens: int) -> list[tuple[float, dict[str, float]]]:
    """Seconds of each of ``n`` short generations of tenant B, one after another, with its engine figures."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        figures = generate(stub, "b", pid, tokens)
        out.append((time.perf_counter() - t0, figures))
    return out


def b_process(address: str, pid: str, conn: Any) -> None:
    """Tenant B (in B's process): for each ``(n, tokens)`` received, run the requests and send back their latencies."""
    stub = pb_grpc.WorkerStub(channel(address))
    while (job := conn.recv()) is not None:
        conn.send(b_latencies(stub, pid, *job))


def flood(address: str, pid: str, tokens: int, stop: Any, pieces: Any, refused: Any) -> None:
    """One of tenant A's streams (in A's process): max-length generations until ``stop`` is set."""
    stub = pb_grpc.WorkerStub(channel(address))
    while not stop.is_set():
        try:
            for ev in stub.Generate(pb.GenerateRequest(prefix_id=pid, query=" Where does the river go?",
                                                       max_new_tokens=tokens), metadata=MD["a"], timeout=3600):
                if stop.is_set():
                    return
                if not ev.HasField("done"):
                    with pieces.get_lock():
                        pieces.value += 1
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            with refused.get_lock():
                refused.value += 1
            stop.wait(float(retry_after_of(e) or 1))


def flood_process(address: str, pid: str, streams: int, tokens: int, stop: Any, pieces: Any, refused: Any) -> None:
    """Tenant A: ``streams`` concurrent streams in this process."""
    threads = [threading.Thread(target=flood, args=(address, pid, tokens, stop, pieces, refused), daemon=True)
               for _ in range(streams)]
    for t in threads:
        t.start()
    stop.wait()


def p95(xs: list[float]) -> float:
    """95th percentile (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.95 * len(s)) - 1))]


def run(args: argparse.Namespace, home: Path) -> dict:
    """Both phases on one worker server; the measurements."""
    positions = max(4096, 2 * args.a_tokens)
    if args.shape == "tiny":
        spec = TinyLlamaSpec(seed=0, never_eos=True, max_positions=positions)
    else:  # Llama-3.1-8B's layer shape, fewer layers: steps cost what a real model's do, not interpreter overhead
        spec = llama8b_attention_spec(args.layers, positions, intermediate_size=14336, never_eos=True)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    lm = load_model(str(build_tiny_llama(home / "model", spec)), device=args.device, dtype=dtype, progress=False)
    store = KVStore(StoreConfig(home=home / "store", page_size=lm.layout.page_size))
    worker = Worker(store, lm, progress=False)
    cfg = ServerConfig(port=_free_port())
    server, _ = build_worker_server(worker, cfg, KEYS, WorkerLimits(max_new_tokens_cap=args.a_tokens),
                                    SchedulerConfig(max_per_tenant=args.max_per_tenant,
                                                    max_active=2 * args.max_per_tenant,
                                                    hand_back_s=args.hand_back_ms / 1000))
    server.start()
    ctx = multiprocessing.get_context("spawn")
    b_conn, b_end = ctx.Pipe()
    b_proc = None
    try:
        stub = pb_grpc.WorkerStub(channel(cfg.address))
        pids = {t: stub.Prefill(iter([pb.PrefillChunk(text=DOC)]), metadata=MD[t]).prefix_id for t in MD}
        b_proc = ctx.Process(target=b_process, args=(cfg.address, pids["b"], b_end), daemon=True)
        b_proc.start()

        figures: dict[str, list[dict[str, float]]] = {"alone": [], "loaded": []}

        def b_run(n: int, phase: str = "") -> list[float]:
            b_conn.send((n, args.b_tokens))
            got = b_conn.recv()
            if phase:
                figures[phase] += [f for _, f in got]
            return [s for s, _ in got]

        b_run(2)  # warm-up
        alone: list[float] = []
        loaded: list[float] = []
        rates, refusals = [], 0
        per_round = max(1, args.b_requests // args.rounds)
        for _ in range(args.rounds):  # alternate, so a drift in the machine's load hits both phases alike
            alone += b_run(per_round, "alone")
            b, rate, refused = _loaded_phase(args, ctx, cfg.address, pids, per_round, lambda k: b_run(k, "loaded"))
            loaded += b
            rates.append(rate)
            refusals += refused
    finally:
        if b_proc is not None:
            b_conn.send(None)
            b_proc.join(30)
        server.stop(0)
        store.close()
    return {"device": str(lm.device), "shape": args.shape, "layers": spec.n_layers,
            "b_requests": args.b_requests, "b_tokens": args.b_tokens,
            "a_streams": args.a_streams, "a_tokens": args.a_tokens, "max_per_tenant": args.max_per_tenant,
            "b_p50_alone_s": statistics.median(alone), "b_p95_alone_s": p95(alone),
            "b_p50_loaded_s": statistics.median(loaded), "b_p95_loaded_s": p95(loaded),
            "p95_ratio": p95(loaded) / p95(alone), "a_refused": refusals, "a_pieces_per_s": statistics.mean(rates),
            "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
            "b_engine": {phase: {k: statistics.median(f[k] for f in fs if k in f) for k in ENGINE_FIGURES
                                 if any(k in f for f in fs)} for phase, fs in figures.items()}}


def _loaded_phase(args: argparse.Namespace, ctx: Any, address: str, pids: dict[str, str], n: int,
                  b_run: Any) -> tuple[list[float], float, int]:
    """B's latencies while A floods from its own process; A's piece rate meanwhile; A's refusals."""
    stop, pieces, refused = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    a = ctx.Process(target=flood_process, args=(address, pids["a"], args.a_streams, args.a_tokens, stop, pieces,
                                                refused))
    a.start()
    try:
        while pieces.value < args.a_streams:  # A's generations under way before B starts
            time.sleep(0.05)
        time.sleep(args.settle_s)
        t0, p0 = time.perf_counter(), pieces.value
        loaded = b_run(n)
        return loaded, (pieces.value - p0) / (time.perf_counter() - t0), refused.value
    finally:
        stop.set()
        a.join(30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=("tiny", "8b"), default="tiny",
                   help="tiny: the 2-layer test model; 8b: Llama-3.1-8B's layer shape with --layers layers")
    p.add_argument("--layers", type=int, default=4, help="layers of the 8b shape")
    p.add_argument("--b-requests", type=int, default=200, help="short requests of tenant B per phase")
    p.add_argument("--b-tokens", type=int, default=16)
    p.add_argument("--a-streams", type=int, default=6, help="tenant A's concurrent generations (over its limit)")
    p.add_argument("--a-tokens", type=int, default=4096, help="tokens of each A generation (the worker's cap)")
    p.add_argument("--max-per-tenant", type=int, default=4)
    p.add_argument("--hand-back-ms", type=float, default=SchedulerConfig.hand_back_s * 1000,
                   help="the scheduler's hand-back wait (SchedulerConfig.hand_back_s)")
    p.add_argument("--rounds", type=int, default=4, help="alone/loaded phases, alternated")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the worker (0: torch's default)")
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="few, short requests (smoke run)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.b_requests, args.b_tokens, args.a_streams, args.a_tokens, args.settle_s, args.rounds = 8, 8, 5, 512, 0.3, 1
    if args.threads:
        torch.set_num_threads(args.threads)  # the worker's intra-op threads: CPU runs only
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args, Path(tmp))
    print(f"device: {r['device']} ({r['torch_threads']} torch threads); model shape {r['shape']}, {r['layers']} "
          f"layers; {r['rounds']} rounds alone/loaded")
    print(f"tenant B: {r['b_requests']} requests of {r['b_tokens']} tokens one after another; tenant A: "
          f"{r['a_streams']} concurrent generations of {r['a_tokens']} tokens (at most {r['max_per_tenant']} "
          f"admitted; {r['a_refused']} refusals retried)\n")
    print("| tenant B | p50 (s) | p95 (s) |")
    print("|---|---|---|")
    print(f"| alone | {r['b_p50_alone_s']:.3f} | {r['b_p95_alone_s']:.3f} |")
    print(f"| while A floods | {r['b_p50_loaded_s']:.3f} | {r['b_p95_loaded_s']:.3f} |")
    print(f"| ratio | {r['b_p50_loaded_s'] / r['b_p50_alone_s']:.2f} | {r['p95_ratio']:.2f} |")
    engine = r["b_engine"]
    print("\n| tenant B, median per request (worker's figures) | TTFT (s) | ms per token | batch | captured steps |")
    print("|---|---|---|---|---|")
    for phase, label in (("alone", "alone"), ("loaded", "while A floods")):
        e = engine.get(phase, {})
        print(f"| {label} | {e.get('ttft_s', float('nan')):.3f} | {e.get('ms_per_token', float('nan')):.1f} | "
              f"{e.get('batch_mean', float('nan')):.1f} | {e.get('graph_steps', float('nan')):.0f} |")
    print(f"\nwhile B ran, A streamed {r['a_pieces_per_s']:.0f} pieces/s over its generations together")
    print(f"p95 ratio {r['p95_ratio']:.2f} (target <= 2.00): {'met' if r['p95_ratio'] <= 2 else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
