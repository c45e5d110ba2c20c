"""Prefill-time cost of KVzip's context-reconstruction scoring against HybridKV's (issue #15).

Through the product's path, ``Worker.prefill(document, compress=[...])`` on the shipped model
(``models/kvstash-tiny`` with its ``hybridkv_heads.json``; ``--device``, ``--dtype``: bf16 on CUDA,
float32 on the CPU by default): one generated document (lab/synth, ``niah_single``) of ``--ctx``
tokens is prefilled fresh (the prefix removed before each call) three ways per round: alone, with
KVzip's scores, with HybridKV's scores (reconstruction scoring on the calibrated heads only). The
three are interleaved, their order rotated round by round, so a shared machine's load hits them
alike; the table gives medians, each method's extra over the prefill alone, and
``hybridkv_extra / kvzip_extra`` (issue's target ≤ 0.65).

A fourth row is a floor, not a product path: the same reconstruction pass with no head scored
(``reconstruction_scores(..., heads=none)``), the forward every scored method must run since later
layers need every head's output. HybridKV's extra can shrink only towards it.

The shipped model's context is 32768 positions, so a ``--ctx`` at or above it is run at
``max_context - 1`` tokens (the worker refuses a document that fills the context).

    python3 bench/bench_compress_time.py                 # 32k on cuda (4k on the cpu)
    python3 bench/bench_compress_time.py --quick         # CPU smoke run (512 tokens, one round)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_device_args, device_and_dtype, seconds, shipped_worker  # noqa: E402
from lab.synth.context import SynthContext  # noqa: E402
from lab.synth.registry import generate as synth  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.methods.reconstruct import reconstruction_scores  # noqa: E402
from workers.methods.source import PrefixSource  # noqa: E402

TASK = "niah_single"
VARIANTS = {"prefill": (), "kvzip": ("kvzip",), "hybridkv": ("hybridkv",)}
"""Row -> the ``compress`` list of its prefill."""
FLOOR = "forward only"


def fresh_prefill(worker: Worker, doc: str, compress: tuple[str, ...]) -> tuple[float, float]:
    """(seconds of a prefill that finds nothing stored, seconds of its scoring pass alone: 0 without one)."""
    pid = worker.prefix_key(worker.tokenize_document(doc)).prefix_id
    if worker.store.find(pid) is not None:
        worker.remove_prefix(pid)
    worker.compressions.seconds.pop("score", None)
    s = seconds(lambda: worker.prefill(doc, compress=compress), worker.lm.device)
    return s, worker.compressions.seconds.get("score", 0.0)


def forward_only(worker: Worker, doc: str) -> float:
    """Seconds of the reconstruction pass scoring no head (the stored prefix read first, outside the clock)."""
    pre = worker.prefill(doc)
    source = PrefixSource(worker.store, pre.manifest, worker.lm.device)
    kv = [source.layer_kv(layer) for layer in range(pre.manifest.layout.n_layers)]
    ids = worker.tokenize_document(doc)
    none = torch.zeros(worker.lm.layout.n_layers, worker.lm.layout.n_kv_heads, dtype=torch.bool)
    return seconds(lambda: reconstruction_scores(worker.lm, ids, kv, heads=none), worker.lm.device)


def one_round(worker: Worker, doc: str, r: int) -> dict[str, tuple[float, float]]:
    """Every row once, in an order rotated by ``r``; progress printed as it goes."""
    names = list(VARIANTS) + [FLOOR]
    out: dict[str, tuple[float, float]] = {}
    for name in names[r % len(names):] + names[:r % len(names)]:
        out[name] = (forward_only(worker, doc), 0.0) if name == FLOOR else fresh_prefill(worker, doc, VARIANTS[name])
        print(f"  round {r}: {name} {out[name][0]:.3f} s (scoring {out[name][1]:.3f} s)", flush=True)
    return out


def summarize(rounds: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """Medians over the measured rounds, the extras over the prefill alone (per round, then median), the ratio."""
    med = {name: statistics.median(r[name][0] for r in rounds) for name in rounds[0]}
    extra = {m: statistics.median(r[m][0] - r["prefill"][0] for r in rounds) for m in ("kvzip", "hybridkv")}
    score = {m: statistics.median(r[m][1] for r in rounds) for m in ("kvzip", "hybridkv")}
    return {**{f"{k}_s": v for k, v in med.items()}, **{f"{m}_extra_s": v for m, v in extra.items()},
            **{f"{m}_score_s": v for m, v in score.items()},
            "ratio_extra": extra["hybridkv"] / extra["kvzip"] if extra["kvzip"] > 0 else float("nan"),
            "ratio_score": score["hybridkv"] / score["kvzip"] if score["kvzip"] > 0 else float("nan"),
            "floor_over_kvzip_score": med[FLOOR] / score["kvzip"] if score["kvzip"] > 0 else float("nan")}


def print_table(n_tokens: int, s: dict[str, float]) -> None:
    """The results as a markdown table."""
    print(f"\n| {n_tokens} tokens | median s | extra over prefill s | scoring pass alone s |")
    print("|---|---|---|---|")
    print(f"| prefill alone | {s['prefill_s']:.3f} | | |")
    for m in ("kvzip", "hybridkv"):
        print(f"| prefill + {m} scoring | {s[f'{m}_s']:.3f} | {s[f'{m}_extra_s']:.3f} | {s[f'{m}_score_s']:.3f} |")
    print(f"| reconstruction forward, no head scored (floor) | | | {s[f'{FLOOR}_s']:.3f} |")
    print(f"| **hybridkv / kvzip** | | **{s['ratio_extra']:.2f}** | {s['ratio_score']:.2f} |")
    print(f"\nfloor / kvzip scoring = {s['floor_over_kvzip_score']:.2f} (issue's target: hybridkv_extra / kvzip_extra "
          "<= 0.65)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=None, help="document tokens (default: 32768 on cuda, 4096 on cpu)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after --warmup ones); median")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (kernels, allocator)")
    p.add_argument("--home", type=Path, default=None, help="store directory (default: temp)")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, one round, cpu unless --device")
    add_device_args(p)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.ctx, args.rounds, args.warmup, args.device = 512, 1, 0, args.device or "cpu"
    device, dtype = device_and_dtype(args.device, args.dtype)
    worker, store = shipped_worker(Path(args.home or tempfile.mkdtemp(prefix="kvstash-compress-bench-")),
                                   device=device, dtype=dtype)
    if worker.lm.head_scores is None:
        raise SystemExit("the shipped model has no hybridkv_heads.json: HybridKV cannot score")
    n_ctx = min(args.ctx or (32768 if device.type == "cuda" else 4096), worker.lm.max_context - 1)
    doc = synth(TASK, n_ctx, seed=7, ctx=SynthContext(tokenizer=worker.lm.tokenizer, split="eval")).document
    n_tokens = len(worker.tokenize_document(doc))
    heads = worker.lm.head_scores.top(worker.lm.head_scores.head_fraction)
    print(f"document {n_tokens} tokens (--ctx {args.ctx}, model context {worker.lm.max_context}); HybridKV scores "
          f"{sum(map(sum, heads))} of {worker.lm.layout.n_layers * worker.lm.layout.n_kv_heads} KV heads; "
          f"{args.warmup} warm-up + {args.rounds} rounds", flush=True)
    for r in range(args.warmup):  # first-use costs (kernels, allocator), not measured
        one_round(worker, doc, r)
    rounds: list[dict[str, tuple[float, float]]] = []
    summary: dict[str, float] = {}
    for r in range(args.rounds):
        rounds.append(one_round(worker, doc, r))
        summary = summarize(rounds)
        if args.json:  # after each round: a run killed later keeps what it measured
            args.json.write_text(json.dumps({"device": str(device), "dtype": dtype, "n_tokens": n_tokens,
                                             "rounds": rounds, "summary": summary}, indent=2))
    print_table(n_tokens, summary)
    store.close()


if __name__ == "__main__":
    main()
