"""What several benches share: the random models and documents they run, timing a call, and dropping the OS page
cache."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lab.synth.context import SynthContext
from lab.synth.registry import generate as synth
from lab.synth.sample import Sample
from lab.tiny_random import TinyLlamaSpec, build_tiny_llama
from store.config import StoreConfig
from store.kvstore import KVStore
from workers.engine import PrefillResult, Worker
from workers.model import LoadedModel, load_model
from workers.model_source import SHIPPED_MODEL_NAME, SHIPPED_MODELS_DIR

QUICK_SPEC = TinyLlamaSpec(hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_positions=4096, init_range=0.02)
"""The CPU smoke runs' model (``--quick``)."""


def llama8b_attention_spec(n_layers: int, max_positions: int, *, intermediate_size: int = 4096,
                           never_eos: bool = False) -> TinyLlamaSpec:
    """Random weights with Llama-3.1-8B's attention shape (hidden 4096, 32 q / 8 KV heads, D=128), ``n_layers``
    layers; the MLP is narrower unless ``intermediate_size`` says otherwise (14336 is the real one)."""
    return TinyLlamaSpec(hidden_size=4096, intermediate_size=intermediate_size, n_layers=n_layers, n_heads=32,
                         n_kv_heads=8, max_positions=max_positions, init_range=0.02, never_eos=never_eos)


def drop_os_cache() -> bool:
    """Drop the OS page cache so "cold" reads come from the disk (root only); whether it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


WORDS = ["river", "stone", "light", "quiet", "north", "field", "paper", "cloud", "ember", "glass"]


def document(n_chars: int, seed: int = 0) -> str:
    """A random word document of ``n_chars`` characters (the random models' tokenizer is byte-level)."""
    rng = random.Random(seed)
    doc = ""
    while len(doc) < n_chars:
        doc += rng.choice(WORDS) + " "
    return doc[:n_chars]


def load_random_model(spec: TinyLlamaSpec, work: Path, page_size: int = 16) -> LoadedModel:
    """A random-weight model built into ``work`` and loaded through the product's loader (bf16 on CUDA, fp32 on
    the CPU), its EOS switched off so every generation decodes the steps it was asked for."""
    import torch

    cuda = torch.cuda.is_available()
    lm = load_model(str(build_tiny_llama(work / "model", spec)), device="cuda" if cuda else "cpu",
                    dtype="bfloat16" if cuda else "float32", page_size=page_size, progress=False)
    lm.model.generation_config.eos_token_id = []
    return lm


def timed(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` unmeasured ones (CUDA work synchronized)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shipped_cpu_worker(home: Path, offload: str = "default") -> tuple[Worker, KVStore]:
    """A worker on the CPU over the shipped model (float32) with a store in ``home``; ``offload="none"`` reads
    each layer from the page files instead of through the worker's page tiers. Prints what it runs."""
    lm = load_model(str(SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME), device="cpu", dtype="float32", progress=False)
    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size))
    worker = Worker(store, lm, progress=False, **({"offload": None} if offload == "none" else {}))
    print(f"cpu, {torch.get_num_threads()} threads; model {SHIPPED_MODEL_NAME} ({lm.layout.n_layers} layers, "
          f"{lm.layout.n_kv_heads} KV heads, D={lm.layout.head_dim}); offload {offload}", flush=True)
    return worker, store


def prefilled_sample(worker: Worker, task: str, n_ctx: int, seed: int = 7) -> tuple[Sample, PrefillResult]:
    """A synthetic ``task`` sample of about ``n_ctx`` tokens (eval split), its document prefilled (or found)."""
    sample = synth(task, n_ctx, seed=seed, ctx=SynthContext(tokenizer=worker.lm.tokenizer, split="eval"))
    t0 = time.perf_counter()
    pre = worker.prefill(sample.document)
    print(f"[{n_ctx}] prefix {pre.n_tokens} tokens ({'cached' if pre.cached else 'prefilled'} in "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)
    return sample, pre
