"""Prefill throughput with and without the store, side by side in one run.

The product's prefill (`Worker.prefill`: the chunked forward pass, then every layer's pages written to
the store with its summaries and committed) against the same chunked forward pass alone
(`workers.prefill.prefill_kv`, each layer's K/V taken and dropped), over the same document and model.
The issue's target is tokens/s with the store >= 0.9x without. The store's default commits once the bytes are
written and fsyncs them in the background (`StoreConfig.sync_after_commit`): its row is the time until the
prefill returns (the prefix is served from then on), and the next row the time until the background fsync is
done too. Then `sync_after_commit=False` (every file fsync'd before the commit), and the disk: the bytes the
store wrote, at the disk's fsync'd sequential write speed measured in the same run, is a floor for any prefill
that waits for the disk (the pages and summaries of 128k tokens over 32 layers are about 25 GB). ``--dynamic``
adds the forward pass over transformers' own dynamic cache (a concatenation per chunk), for what the in-place
cache saves.

    python3 bench/bench_prefill.py --ctx 131072 --layers 32 --full-mlp --json out.json
    python3 bench/bench_prefill.py --quick          # smoke run (tiny shape, CPU)
    python3 bench/bench_prefill.py --ctx 131072 --layers 32 --full-mlp --phases   # where the default row's time goes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import prefill_phases  # noqa: E402
from bench.common import (  # noqa: E402
    describe_device,
    document,
    in_scratch_dir,
    llama8b_attention_spec,
    load_random_model,
    sync,
)
from lab.tiny_random import TinyLlamaSpec  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from workers import engine, prefill  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.late_summaries import LATE_POLICIES, LatePolicy  # noqa: E402
from workers.model import LoadedModel  # noqa: E402

ROW_WHEN = {"returned": "until it returns (Quest, Top-K and MoBA serve the prefix from then on)",
            "summarized": "until its late summaries (Double-P's clusters, the φ cache, the value index) are built too",
            "durable": "until the background fsync is done too"}
"""The default prefill's rows: what each one waits for."""
WARMUP_TOKENS = 2048
"""A short prefill before the measured rows (kernels, allocator, cuBLAS handles)."""
DISK_PROBE_BYTES = 2 << 30
"""Bytes written (and fsync'd) to time the disk's sequential write speed in the run (at most the store's bytes)."""
DISK_PROBE_BLOCK = 64 << 20


def forward_only(lm: LoadedModel, ids: list[int], chunk: int) -> None:
    """The chunked forward pass alone: each layer's K/V taken, then dropped."""
    for _, k, v in prefill.prefill_kv(lm, ids, chunk_size=chunk, progress=False):
        del k, v


def with_store(lm: LoadedModel, doc: str, home: Path, chunk: int, *, sync_after_commit: bool,
               summaries_beside: bool = False, late: LatePolicy = "auto",
               late_parts: dict[str, float] | None = None) -> dict[str, float]:
    """``Worker.prefill`` of the document into a fresh store (the product path): seconds until it returned, until
    its late summaries were built too (``workers.late_summaries``), and until the store's background fsync was done
    as well; the bytes it wrote (then removed: two 128k stores would not fit some disks). With ``late_parts``, the
    late build is timed by part into it (``LateSummaries.timed``: the device synchronized per part)."""
    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size, sync_after_commit=sync_after_commit))
    try:
        t0 = time.perf_counter()
        # The default offload, as a product worker has it: the late build reads through its host tier.
        worker = Worker(store, lm, progress=False, chunk_size=chunk, summaries_beside=summaries_beside,
                        late_summaries=late)
        worker.late.timed = late_parts is not None
        worker.prefill(doc)
        returned = time.perf_counter() - t0
        worker.late.close()
        sync(lm.device)
        summarized = time.perf_counter() - t0
        if late_parts is not None:
            late_parts.update(worker.late.parts)
        store.flush()
        return {"returned": returned, "summarized": summarized, "durable": time.perf_counter() - t0,
                "bytes": stored_bytes(home)}
    finally:
        store.close()
        shutil.rmtree(home, ignore_errors=True)


def stored_bytes(home: Path) -> int:
    """Bytes of every file the store wrote under ``home`` (page files, artifacts, metadata)."""
    return sum(p.stat().st_size for p in home.rglob("*") if p.is_file())


def disk_write_speed(directory: Path, n_bytes: int) -> float:
    """Bytes/s of one sequential write of ``n_bytes`` to a new file in ``directory``, fsync'd (then removed)."""
    block = os.urandom(DISK_PROBE_BLOCK)
    path = directory / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, n_bytes // len(block))):
            f.write(block)
        os.fsync(f.fileno())
    s = time.perf_counter() - t0
    written = path.stat().st_size
    path.unlink()
    return written / s


def timed_row(name: str, fn: Callable[[], object], device: torch.device, n_tokens: int) -> dict:
    """Seconds and tokens/s of one run of ``fn``."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    s = time.perf_counter() - t0
    print(f"  {name}: {s:.2f} s", flush=True)
    return {"name": name, "seconds": s, "tokens_per_s": n_tokens / s}


def compared_rows(lm: LoadedModel, doc: str, work: Path, chunk: int, n_tokens: int) -> list[dict]:
    """The prefill with every summary inline, and with them on a side stream, until each returns."""
    rows = []
    variants = (("inline", "every summary computed in the prefill (`late_summaries=\"inline\"`)",
                 {"late": "inline"}),
                ("beside", "every summary computed in the prefill on a side stream (`summaries_beside=True`)",
                 {"late": "inline", "summaries_beside": True}))
    for key, what, kw in variants:
        t = with_store(lm, doc, work / f"store-{key}", chunk, sync_after_commit=True, **kw)
        name = f"`Worker.prefill`, {what}: returned"
        print(f"  {name}: {t['returned']:.2f} s", flush=True)
        rows.append({"name": name, "key": key, "seconds": t["returned"], "tokens_per_s": n_tokens / t["returned"]})
    return rows


def bare_row(lm: LoadedModel, doc: str, work: Path, chunk: int, n_tokens: int) -> dict:
    """The prefill without any summary (pages, CRCs, commit), until it returns."""
    saved_summarizers = engine.build_summarizers
    engine.build_summarizers = lambda *a, **kw: []  # type: ignore[assignment]
    try:
        t = with_store(lm, doc, work / "store-bare", chunk, sync_after_commit=True, late="inline")
    finally:
        engine.build_summarizers = saved_summarizers  # type: ignore[assignment]
    name = "`Worker.prefill` without any summary (pages, CRCs, commit only): returned"
    print(f"  {name}: {t['returned']:.2f} s", flush=True)
    return {"name": name, "key": "bare", "seconds": t["returned"], "tokens_per_s": n_tokens / t["returned"]}


def run(args: argparse.Namespace, work: Path) -> dict:
    """Every row over the same document and model."""
    if args.quick:
        spec = TinyLlamaSpec(hidden_size=256, intermediate_size=256, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                             max_positions=args.ctx + 1024, init_range=0.02)
    else:
        spec = llama8b_attention_spec(args.layers, args.ctx + 1024, intermediate_size=14336 if args.full_mlp else 4096)
    lm = load_random_model(spec, work)
    doc = document(args.ctx - 1)
    ids = list(lm.tokenizer(doc).input_ids)
    forward_only(lm, ids[:WARMUP_TOKENS], args.chunk)
    for after in (True, False):
        with_store(lm, doc[:WARMUP_TOKENS], work / f"warm-{after}", args.chunk, sync_after_commit=after)
    dev = lm.device
    rows = [timed_row("forward only (in-place cache)", lambda: forward_only(lm, ids, args.chunk), dev, len(ids))]
    extra: dict[str, object] = {}
    rows[0]["key"] = "forward"
    if args.phases:
        with prefill_phases.phases(dev) as clock:
            t = with_store(lm, doc, work / "store", args.chunk, sync_after_commit=True)
        print(f"  `Worker.prefill` (phases timed, device synchronized per phase): {t['returned']:.2f} s", flush=True)
        return {"device": describe_device(dev), "ctx": len(ids), "layers": spec.n_layers, "rows": rows,
                "prefill_s": t["returned"], "phases": dict(clock.seconds)}
    for after, home in ((True, "store"), (False, "store-sync"))[: 1 if args.no_sync_row else 2]:
        sync(dev)
        t = with_store(lm, doc, work / home, args.chunk, sync_after_commit=after, late=args.late)
        for what in ("returned", "summarized", "durable") if after else ("durable",):
            name = (f"`Worker.prefill`, the default: {ROW_WHEN[what]}" if after else
                    "`Worker.prefill`, every file fsync'd before the commit, until durable")
            print(f"  {name}: {t[what]:.2f} s", flush=True)
            rows.append({"name": name, "key": f"default-{what}" if after else "sync-first", "seconds": t[what],
                         "tokens_per_s": len(ids) / t[what]})
    n_bytes = int(t["bytes"])
    speed = disk_write_speed(work, min(n_bytes, DISK_PROBE_BYTES))
    floor = n_bytes / speed  # the store's bytes cannot reach the disk faster than this
    print(f"  the store wrote {n_bytes / 1e9:.2f} GB; the disk writes {speed / 1e9:.2f} GB/s (fsync'd): "
          f"{floor:.2f} s at least", flush=True)
    rows.append({"name": "the store's bytes at the disk's write speed (a floor for the row above)", "key": "disk",
                 "seconds": floor, "tokens_per_s": len(ids) / floor, "bytes": n_bytes, "disk_bytes_per_s": speed})
    if args.late_profile:  # after the rows above: its synchronizations would slow their overlap
        parts: dict[str, float] = {}
        t = with_store(lm, doc, work / "store-profiled", args.chunk, sync_after_commit=True, late="background",
                       late_parts=parts)
        late_s = t["summarized"] - t["returned"]
        print(f"  late build, profiled (device synchronized per part): {late_s:.2f} s after the return", flush=True)
        for name, s in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"    {name}: {s:.2f} s ({s / late_s:.2f} of it)", flush=True)
        extra["late_profile"] = {"after_return_s": late_s, "parts": parts}
    if args.compare:
        rows += compared_rows(lm, doc, work, args.chunk, len(ids))
    if args.compare or args.bare:
        rows.append(bare_row(lm, doc, work, args.chunk, len(ids)))
    if args.dynamic:
        saved = prefill.filled_cache
        prefill.filled_cache = lambda lm, n: DynamicCache(config=lm.model.config)  # type: ignore[assignment]
        try:
            rows.append(timed_row("forward only (transformers' dynamic cache)",
                                  lambda: forward_only(lm, ids, args.chunk), dev, len(ids)))
        finally:
            prefill.filled_cache = saved
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_forward"] = r["tokens_per_s"] / base
    return {"device": describe_device(dev), "ctx": len(ids), "layers": spec.n_layers, "chunk": args.chunk,
            "mlp": spec.intermediate_size, "rows": rows, **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--full-mlp", action="store_true", help="Llama-3.1-8B's MLP width (14336), not 4096")
    p.add_argument("--chunk", type=int, default=prefill.DEFAULT_CHUNK)
    p.add_argument("--dynamic", action="store_true", help="add the forward pass over transformers' dynamic cache")
    p.add_argument("--compare", action="store_true",
                   help="add the default prefill with summaries on a side stream, and without any summary")
    p.add_argument("--bare", action="store_true", help="add the prefill without any summary (--compare adds it too)")
    p.add_argument("--no-sync-row", action="store_true",
                   help="leave out the prefill that fsyncs every file before its commit (one whole prefill less)")
    p.add_argument("--late", choices=LATE_POLICIES, default="auto",
                   help="the default rows' late-summaries policy (auto: background on CUDA, on_use elsewhere)")
    p.add_argument("--late-profile", action="store_true",
                   help="add one more prefill whose late build is timed by summarizer and read wait")
    p.add_argument("--quick", action="store_true", help="tiny shape (smoke run)")
    p.add_argument("--phases", action="store_true", help="only the forward and the default prefill, its time by phase")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.ctx, args.layers, args.dynamic, args.compare, args.late_profile = 4096, 2, True, True, True
    out: list[dict] = []
    in_scratch_dir(lambda work: out.append(run(args, work)), prefix="kvstash-prefill-")  # removed on SIGTERM too
    r = out[0]
    if args.phases:
        print(f"\ndevice: {r['device']}; forward alone {r['rows'][0]['seconds']:.2f} s, `Worker.prefill` "
              f"{r['prefill_s']:.2f} s\n\n| phase | s |\n|---|---|")
        for name, s in sorted(r["phases"].items()):
            print(f"| {name} | {s:.2f} |")
        if args.json:
            args.json.write_text(json.dumps(r, indent=2))
        return
    print(f"\ndevice: {r['device']}; {r['ctx']} tokens, {r['layers']} layers (MLP {r['mlp']}), chunks of {r['chunk']}")
    print("\n| prefill | s | tokens/s | vs forward only |")
    print("|---|---|---|---|")
    for row in r["rows"]:
        print(f"| {row['name']} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} | {row['vs_forward']:.2f} |")
    by = {row["key"]: row["vs_forward"] for row in r["rows"] if "key" in row}
    ratio = by["default-returned"]
    print(f"\nwith the store (the default, until the prefill returns): {ratio:.2f}x the forward pass's tokens/s "
          f"(target >= 0.90): {'met' if ratio >= 0.9 else 'NOT met'}; until its late summaries are built "
          f"{by['default-summarized']:.2f}x; until its bytes are on the disk {by['default-durable']:.2f}x"
          + (f"; fsync'd before the commit {by['sync-first']:.2f}x" if "sync-first" in by else "")
          + f", where the disk allows at most {min(1.0, by['disk']):.2f}x")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
