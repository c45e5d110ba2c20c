"""What several benches share: the random models and documents they run, timing a call, and dropping the OS page
cache."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
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
from workers.engine import DEFAULT_OFFLOAD, PrefillResult, Worker
from workers.model import LoadedModel, load_model
from workers.model_source import SHIPPED_MODEL_NAME, SHIPPED_MODELS_DIR

QUICK_SPEC = TinyLlamaSpec(hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_positions=4096, init_range=0.02)
"""The CPU smoke runs' model (``--quick``)."""
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""``--dtype`` names -> torch dtype names."""


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


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one ``fn()``, the device's queued work waited for before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` unmeasured ones (CUDA work synchronized)."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn, device) for _ in range(reps))


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` (default: cuda when available, else cpu) and ``--dtype`` (default: bf16 on cuda, fp32 on cpu)."""
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, str]:
    """The bench's device and torch dtype name from ``add_device_args``' flags (their defaults filled in)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    return dev, DTYPES[dtype or ("bf16" if dev.type == "cuda" else "fp32")]


def describe_device(device: torch.device) -> str:
    """The device in words, for a bench's first line."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu, {torch.get_num_threads()} threads"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shipped_worker(home: Path, offload: str = "default", *, device: torch.device | str = "cpu",
                   dtype: str = "float32") -> tuple[Worker, KVStore]:
    """A worker over the shipped model on ``device`` in ``dtype`` with a store in ``home``; ``offload="none"``
    reads each layer from the page files instead of through the worker's page tiers. Prints what it runs."""
    dev = torch.device(device)
    lm = load_model(str(SHIPPED_MODELS_DIR / SHIPPED_MODEL_NAME), device=str(dev), dtype=dtype, progress=False)
    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size))
    worker = Worker(store, lm, progress=False, offload=None if offload == "none" else DEFAULT_OFFLOAD)
    print(f"{describe_device(dev)}, {dtype}; model {SHIPPED_MODEL_NAME} ({lm.layout.n_layers} layers, "
          f"{lm.layout.n_kv_heads} KV heads, D={lm.layout.head_dim}, max context {lm.max_context}); "
          f"offload {offload}", flush=True)
    return worker, store


def prefilled_sample(worker: Worker, task: str, n_ctx: int, seed: int = 7) -> tuple[Sample, PrefillResult]:
    """A synthetic ``task`` sample of about ``n_ctx`` tokens (eval split), its document prefilled (or found)."""
    sample = synth(task, n_ctx, seed=seed, ctx=SynthContext(tokenizer=worker.lm.tokenizer, split="eval"))
    t0 = time.perf_counter()
    pre = worker.prefill(sample.document)
    print(f"[{n_ctx}] prefix {pre.n_tokens} tokens ({'cached' if pre.cached else 'prefilled'} in "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)
    return sample, pre


def in_scratch_dir(fn: Callable[[Path], object], prefix: str = "kvstash-bench-") -> None:
    """Run ``fn`` on a new temp dir, removed afterwards whatever happens, a SIGTERM included (a store's page files
    are tens of GB at 128k: never left behind, also not by a bench that ``timeout`` stops)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    # SIGTERM's default action ends the process without unwinding; as an exception, the cleanup below runs.
    on_main = threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main else None
    try:
        fn(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if on_main:
            signal.signal(signal.SIGTERM, saved)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
