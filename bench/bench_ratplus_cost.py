"""What RAT+'s decaying memory costs: prefill tokens/s and decode ms/token against the plain model (issue #17).

Two models of one shape built from their shipped ``config.json`` (``models/kvstash-tiny-cont``: plain
Llama; ``models/kvstash-tiny-rat``: RAT+, a decaying memory in every layer, ``workers/ratplus``) with
**random weights** drawn from one seed, same ``--dtype`` (bf16 on CUDA, float32 on the CPU by default):
the cost does not depend on trained weights, and the trained RAT weights cannot travel with the GPU run.
Each is saved with the shipped tokenizer and loaded through the product's loader into a ``Worker`` over
its own store. At each ``--ctx``, one generated document (lab/synth, ``niah_single``) is, per round and
per model (the models interleaved, their order alternating):

- prefilled fresh through ``Worker.prefill`` (the prefix removed first; the forward, page writes and
  summaries): prefill tokens/s;
- run through the prefill forward alone (``prefill_kv``, no store): forward tokens/s;
- decoded with full attention for ``--tokens`` greedy steps (EOS off): median step ms after the query's
  forward.

Medians over ``--rounds`` after ``--warmup`` unmeasured rounds; the table gives RAT+ / plain ratios.

    python3 bench/bench_ratplus_cost.py                  # 4k and 16k (cuda when available)
    python3 bench/bench_ratplus_cost.py --quick          # CPU smoke run (512 tokens, one round)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_device_args, describe_device, device_and_dtype, seconds  # noqa: E402
from lab.synth.context import SynthContext  # noqa: E402
from lab.synth.registry import generate as synth  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.model import load_model  # noqa: E402
from workers.model_source import SHIPPED_MODELS_DIR  # noqa: E402
from workers.prefill import prefill_kv  # noqa: E402
from workers.ratplus import has_decaying_memory, register_rat  # noqa: E402
from workers.requests import GenerationStats, SamplingParams  # noqa: E402

MODELS = {"plain": "kvstash-tiny-cont", "rat+": "kvstash-tiny-rat"}
"""Row -> the shipped model whose config (not weights) it is built from."""
COPIED = ("config.json", "generation_config.json", "kvstash.json", "tokenizer.json", "tokenizer_config.json")
TASK = "niah_single"


def random_from_config(name: str, work: Path, seed: int) -> Path:
    """A folder with the shipped model ``name``'s config and tokenizer and random weights (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    for f in COPIED:
        shutil.copy(SHIPPED_MODELS_DIR / name / f, out / f)
    register_rat()  # the RAT+ config type known to the Auto classes
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


def worker_for(name: str, work: Path, seed: int, device: torch.device, dtype: str) -> tuple[Worker, KVStore]:
    """A worker over the random ``name`` model on ``device`` (EOS off), with its own store under ``work``."""
    lm = load_model(str(random_from_config(name, work / "models", seed)), device=str(device), dtype=dtype,
                    progress=False)
    lm.model.generation_config.eos_token_id = []  # every generation decodes the steps it was asked for
    store = KVStore(StoreConfig(home=work / "stores" / name, page_size=lm.layout.page_size))
    return Worker(store, lm, progress=False), store


def measure(worker: Worker, doc: str, query: str, n_new: int) -> dict[str, float]:
    """One round of one model: fresh product prefill, forward alone, one full-attention generation."""
    dev = worker.lm.device
    ids = worker.tokenize_document(doc)
    pid = worker.prefix_key(ids).prefix_id
    if worker.store.find(pid) is not None:
        worker.remove_prefix(pid)
    prefill_s = seconds(lambda: worker.prefill(doc), dev)
    forward_s = seconds(lambda: list(prefill_kv(worker.lm, ids, chunk_size=worker.chunk_size, progress=False)), dev)
    st = GenerationStats()
    list(worker.generate(pid, query, SamplingParams(max_new_tokens=n_new), method="full", raw=True, stats=st))
    steps = st.step_seconds[1:]  # the first step is the query's forward
    return {"prefill_tok_s": len(ids) / prefill_s, "forward_tok_s": len(ids) / forward_s,
            "decode_ms": 1e3 * statistics.median(steps) if steps else float("nan"), "n_tokens": len(ids)}


def run_ctx(workers: dict[str, Worker], n_ctx: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Interleaved rounds at one length; medians per model."""
    tok = next(iter(workers.values())).lm.tokenizer  # both models ship the same tokenizer
    sample = synth(TASK, n_ctx, seed=7, ctx=SynthContext(tokenizer=tok, split="eval"))
    got: dict[str, list[dict[str, float]]] = {m: [] for m in workers}
    for r in range(args.warmup + args.rounds):
        order = list(workers) if r % 2 == 0 else list(reversed(workers))
        for m in order:
            res = measure(workers[m], sample.document, sample.query, args.tokens)
            tag = "warm-up" if r < args.warmup else f"round {r - args.warmup}"
            print(f"  [{n_ctx}] {tag} {m}: prefill {res['prefill_tok_s']:.0f} tok/s, forward "
                  f"{res['forward_tok_s']:.0f} tok/s, decode {res['decode_ms']:.2f} ms/token", flush=True)
            if r >= args.warmup:
                got[m].append(res)
    return {m: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for m, rows in got.items()}


def print_table(results: dict[int, dict[str, dict[str, float]]]) -> None:
    """RAT+ against plain at every length, as a markdown table."""
    print("\n| ctx | metric | plain | RAT+ | RAT+ / plain |")
    print("|---|---|---|---|---|")
    for n_ctx, r in results.items():
        for key, what in (("prefill_tok_s", "prefill tok/s (Worker.prefill)"), ("forward_tok_s", "forward tok/s"),
                          ("decode_ms", "decode ms/token (full)")):
            p, q = r["plain"][key], r["rat+"][key]
            print(f"| {n_ctx} | {what} | {p:.4g} | {q:.4g} | {q / p:.2f} |")
    print("\n(random weights built from each model's config.json; cost does not depend on trained weights)",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=64, help="decode steps per generation")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per model (interleaved); median")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first at each length")
    p.add_argument("--seed", type=int, default=0, help="weight seed (both models)")
    p.add_argument("--work", type=Path, default=None, help="models and stores directory (default: temp)")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, one round, cpu unless --device")
    add_device_args(p)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.ctx, args.tokens, args.rounds, args.warmup, args.device = [512], 4, 1, 0, args.device or "cpu"
    device, dtype = device_and_dtype(args.device, args.dtype)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvstash-ratplus-bench-"))
    built = {m: worker_for(name, work, args.seed, device, dtype) for m, name in MODELS.items()}
    workers = {m: w for m, (w, _) in built.items()}
    assert has_decaying_memory(workers["rat+"].lm.model.config) and not has_decaying_memory(
        workers["plain"].lm.model.config)
    lay = workers["plain"].lm.layout
    print(f"{describe_device(device)}, {dtype}; random weights (seed {args.seed}) from the configs of "
          f"{', '.join(MODELS.values())} ({lay.n_layers} layers, {lay.n_kv_heads} KV heads, D={lay.head_dim}); "
          f"{args.tokens} decode steps; {args.warmup} warm-up + {args.rounds} rounds", flush=True)
    results: dict[int, dict[str, dict[str, float]]] = {}
    for n_ctx in args.ctx:
        results[n_ctx] = run_ctx(workers, min(n_ctx, workers["plain"].lm.max_context - 1), args)
        if args.json:  # after each length: a run killed later keeps what it measured
            args.json.write_text(json.dumps({"device": str(device), "dtype": dtype, "random_weights": True,
                                             "seed": args.seed, "results": results}, indent=2))
    print_table(results)
    for _, store in built.values():
        store.close()


if __name__ == "__main__":
    main()
