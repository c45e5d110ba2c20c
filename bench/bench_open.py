"""Fast open over a saved prefix: time to open + first token, cold vs warm; page-CRC verification and
random page reads, before vs after. Everything measured side by side in one run; ratios are the result.

1. **CRC verification** of one layer's worth of pages (``--crc-mb``, the model's page size and 8 KiB):
   *before* = the previous ``verify_pages`` (one ``zlib.crc32`` per page from Python, stdlib zlib,
   on 1 and ``io_threads`` threads); *batched, stdlib zlib* = one CRC call per 1 MiB chunk checked
   against the chunk CRC derived from the stored page CRCs; *after* = the same with ``store.crc32``
   (zlib-ng's SIMD CRC-32 when it is installed), 1 and ``io_threads`` threads.
2. **Random page reads** over the prefix's layer files: one page per read at random offsets, 1 and
   ``io_depth`` reads in flight (the fetcher's POSIX reader); page cache dropped first when permitted.
3. **Open + first token** of a new query over the saved prefix through ``Worker.generate`` (greedy,
   ``--tokens`` tokens; time to first token = from the call to the end of the first decode step):
   - *before*: the whole prefix warmed into the host tier first, page CRCs checked per page with
     stdlib zlib (the previous verification), summaries read then hashed, then decode;
   - *blocking warm*: the same with the new verification;
   - *fast open*: decoding starts at once, pages from SSD on demand while the tier warms in the
     background, switching to the device-planned cache when warm;
   - *SSD only*: no warm-up at all, the summaries streamed (each layer's used as it arrives, the digest
     checked before the first token goes out: ``workers.offload.streamed_summary``); and the same with the
     summaries read whole before use, by 4 readers beside the hash, or as before ``store.hashed_read`` (the
     whole file read, then hashed, then parsed by safetensors);
   - *SSD only, shared query pages*: the same with ``DecodeConfig.query_pages="shared"`` (the query's tokens share
     one page selection per chunk: fewer pages read before the first token; its tokens may differ, so the
     same-token check leaves it out and reports it apart);
   - *host-warm*: a second query on the same worker, the prefix whole in its host tier and its
     summaries cached.
   Cold rows run on a fresh worker (its host tier allocated and pinned first, as the worker server
   does at start) after dropping the OS page cache (root only, and not with
   ``--quick`` unless ``--drop-cache yes``: the output states it); each row reports its fastest of
   ``--reps`` runs. Every run must give the same tokens (the bench exits non-zero otherwise).

    python3 bench/bench_open.py --ctx 131072 --layers 8 --json out.json     # H200
    python3 bench/bench_open.py --quick                                      # CPU, about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    document,
    drop_os_cache,
    in_scratch_dir,
    llama8b_attention_spec,
    load_random_model,
)
from lab.tiny_random import TinyLlamaSpec  # noqa: E402
from store import crc_batch, disk_record, page_io  # noqa: E402
from store.artifacts import digest  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.crc32 import CRC32_IMPL  # noqa: E402
from store.errors import CorruptData  # noqa: E402
from store.kvstore import KVStore  # noqa: E402
from store.manifest import Manifest  # noqa: E402
from store.page_io import PosixPageReader, plan_runs, run_all, verify_pages  # noqa: E402
from store.pages import page_crc  # noqa: E402
from workers.engine import Worker  # noqa: E402
from workers.methods.source import PrefixSource  # noqa: E402
from workers.model import LoadedModel  # noqa: E402
from workers.offload import OffloadConfig  # noqa: E402
from workers.requests import DecodeConfig, GenerationStats, SamplingParams  # noqa: E402

QUERY = " What does the text say about the river?"
SECTIONS = {"crc", "reads", "open", "ssd"}
PID = "0123456789abcdef0123456789abcdef"


def best_s(fn: Callable[[], object], reps: int = 5) -> float:
    """Fastest of ``reps`` runs, seconds."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# -- 1. CRC ----------------------------------------------------------------------------------------
def verify_per_page(prefix_id: str, layer: int, n_pages: int, linear: np.ndarray, out: np.ndarray,
                    crcs: np.ndarray, pool: ThreadPoolExecutor | None = None, threads: int = 1) -> None:
    """The verification before this change: one stdlib ``zlib.crc32`` per page from Python, in ``threads`` parts."""
    heads, pages = np.divmod(linear, n_pages)
    want = crcs[heads, pages]
    hs, ps = heads.tolist(), pages.tolist()

    def check(lo: int, hi: int) -> int:
        for i in range(lo, hi):
            seed = zlib.crc32(f"{prefix_id}:{layer}:{hs[i]}:{ps[i]}".encode())
            if zlib.crc32(out[i].data, seed) & 0xFFFFFFFF != want[i]:
                return i
        return -1

    n = len(hs)
    parts = max(1, min(threads, n // 32)) if pool is not None else 1
    edges = np.linspace(0, n, parts + 1).astype(int).tolist()
    if any(i >= 0 for i in run_all(pool, [functools.partial(check, a, b) for a, b in zip(edges[:-1], edges[1:])])):
        raise CorruptData("page failed its checksum")


@contextlib.contextmanager
def stdlib_crc() -> Iterator[None]:
    """Run the batched verification with the stdlib's zlib CRC instead of ``store.crc32``'s."""
    saved = crc_batch.crc32
    crc_batch.crc32 = zlib.crc32
    try:
        yield
    finally:
        crc_batch.crc32 = saved


def crc_section(page_bytes_list: list[int], nbytes: int, threads: int) -> list[dict]:
    """GB/s of each verification variant on ``nbytes`` of random pages, per page size."""
    with ThreadPoolExecutor(threads) as pool:
        return [r for pb in page_bytes_list for r in _crc_rows(pb, nbytes, pool, threads)]


def _crc_rows(pb: int, nbytes: int, pool: ThreadPoolExecutor, threads: int) -> list[dict]:
    n = max(8, nbytes // pb)
    out = np.random.default_rng(0).integers(0, 256, (n, pb), dtype=np.uint8)
    n_pages = n // 8  # 8 KV heads
    linear = np.arange(8 * n_pages, dtype=np.int64)
    heads, pages = np.divmod(linear, n_pages)
    crcs = np.zeros((8, n_pages), dtype=np.uint32)
    crcs[heads, pages] = [page_crc(PID, 5, h, p, out[i].data) for i, (h, p) in enumerate(zip(heads, pages))]
    variants: list[tuple[str, Callable[[], None]]] = [
        ("before: per page, zlib, 1 thread", lambda: verify_per_page(PID, 5, n_pages, linear, out, crcs)),
        (f"before: per page, zlib, {threads} threads",
         lambda: verify_per_page(PID, 5, n_pages, linear, out, crcs, pool, threads)),
        ("batched, zlib, 1 thread", lambda: _with_stdlib(lambda: verify_pages(PID, 5, n_pages, linear, out, crcs))),
        (f"after: batched, {CRC32_IMPL}, 1 thread", lambda: verify_pages(PID, 5, n_pages, linear, out, crcs)),
        (f"after: batched, {CRC32_IMPL}, {threads} threads",
         lambda: verify_pages(PID, 5, n_pages, linear, out, crcs, pool, threads)),
    ]
    gbps = [linear.size * pb / best_s(fn) / 1e9 for _, fn in variants]
    return [{"page_bytes": pb, "variant": name, "gbps": g, "vs_before": g / gbps[0]}
            for (name, _), g in zip(variants, gbps)]


def _with_stdlib(fn: Callable[[], None]) -> None:
    with stdlib_crc():
        fn()


# -- 2. random reads -------------------------------------------------------------------------------
def read_section(store: KVStore, pid: str, depths: list[int], n_reads: int, drop: bool) -> tuple[list[dict], bool]:
    """Random single-page reads over the prefix's layer files at each depth: IOPS and GB/s."""
    m = store.manifest(pid)
    lay = m.layout
    n_keys = lay.n_kv_heads * lay.n_pages(m.n_tokens)
    rng = np.random.default_rng(1)
    rows, dropped = [], False
    per_layer = min(max(1, n_reads // lay.n_layers), n_keys // 2)
    # Even keys only: no two requested pages are adjacent, so each is its own read.
    plans = [plan_runs(np.sort(rng.choice(n_keys // 2, size=per_layer, replace=False)) * 2) for _ in m.files]
    buf = np.zeros((per_layer, lay.page_bytes), dtype=np.uint8)
    for depth in depths:
        pool = ThreadPoolExecutor(depth) if depth > 1 else None
        reader = PosixPageReader(pool=pool, depth=depth)
        f0 = m.files[0]
        reader.read(store.prefix_dir(pid) / f0.name, f0.size, plan_runs(np.arange(max(depth, 8)) * 2), lay.page_bytes,
                    buf)
        dropped = drop and drop_os_cache()  # (the untimed read above started the pool's threads)
        t0 = time.perf_counter()
        calls = sum(reader.read(store.prefix_dir(pid) / f.name, f.size, plan, lay.page_bytes, buf)
                    for f, plan in zip(m.files, plans))
        sec = time.perf_counter() - t0
        reader.close()
        if pool is not None:
            pool.shutdown()
        rows.append({"depth": depth, "reads": calls, "iops": calls / sec, "gbps": calls * lay.page_bytes / sec / 1e9})
    for r in rows:
        r["vs_depth1"] = r["iops"] / rows[0]["iops"]
    return rows, dropped


# -- 3. open + first token -------------------------------------------------------------------------
def generate(worker: Worker, pid: str, n: int, query_pages: str = "token"
             ) -> tuple[GenerationStats, float, float, float]:
    """One greedy generation; (stats, open s, time to first token s, total s), all from the call. Open ends
    when the first decode step starts (the prefix opened, summaries read, a blocking warm-up done)."""
    st = GenerationStats()
    steps = itertools.count()
    at: list[float] = []

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        if next(steps) < 2:
            at.append(time.perf_counter())
        yield

    worker.engine.turn = turn  # held around each decode step
    t0 = time.perf_counter()
    list(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=n), method="quest", raw=True,
                         decode=DecodeConfig(budget=0.02, query_pages=query_pages), stats=st))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    at += [end] * (2 - len(at))
    return st, at[0] - t0, at[1] - t0, end - t0


OPEN_ROWS = ("before", "blocking", "fast", "ssd-before", "ssd-whole", "ssd", "shared", "warm")
"""The open section's rows, in order (``--open-rows`` picks some)."""


def open_section(store: KVStore, lm: LoadedModel, pid: str, base: OffloadConfig, n: int, drop: bool,
                 reps: int, which: tuple[str, ...] = OPEN_ROWS) -> tuple[list[dict], bool]:
    """Time to first token of each way of opening the prefix (see the module docstring) named in ``which``; each
    row's fastest of ``reps`` runs (every run on a fresh worker), printed as soon as it is measured."""
    blocking = dataclasses.replace(base, warm_in_background=False)
    ssd_only = dataclasses.replace(base, warm_host_fraction=0.0)
    # key: (name, config, the old per-page CRC, how summaries are read, query_pages); summary reads: "old" = read
    # then hashed, whole before use; "whole" = read by 4 threads beside the hash, whole before use; "streamed" =
    # the product's: each layer's used as it arrives, the digest checked before the first token goes out
    cold_rows: dict[str, tuple[str, OffloadConfig, bool, str, str]] = {
        "before": ("before: warm whole prefix first, per-page zlib CRC, summaries read then hashed", blocking, True,
                   "old", "token"),
        "blocking": ("blocking warm, batched CRC", blocking, False, "streamed", "token"),
        "fast": ("fast open: background warm, SSD on demand", base, False, "streamed", "token"),
        "ssd-before": ("SSD only (no warm-up), summaries read then hashed (before)", ssd_only, False, "old", "token"),
        "ssd-whole": ("SSD only, summaries read whole first (4 readers beside the hash)", ssd_only, False, "whole",
                      "token"),
        "ssd": ("SSD only (no warm-up), summaries streamed", ssd_only, False, "streamed", "token"),
        "shared": ("SSD only, summaries streamed, the query's tokens share their pages (query_pages=shared)",
                   ssd_only, False, "streamed", "shared"),
    }
    rows, dropped = [], False
    generate(Worker(store, lm, progress=False, offload=blocking), pid, 2)  # untimed: kernel compilation, allocator
    for key in (k for k in OPEN_ROWS if k in which and k in cold_rows):
        name, cfg, old_crc, summary_read, query_pages = cold_rows[key]
        runs = []
        for _ in range(reps):
            dropped = drop and drop_os_cache()
            worker = Worker(store, lm, progress=False, offload=cfg)
            worker.host_tier()  # a serving worker pins its host tier at start, before any request
            saved = page_io.verify_pages, KVStore.artifact, PrefixSource.artifact_streamed
            if old_crc:
                page_io.verify_pages = verify_per_page  # type: ignore[assignment]
            if summary_read == "old":
                KVStore.artifact = read_then_hash  # type: ignore[assignment,method-assign]
            if summary_read != "streamed":
                PrefixSource.artifact_streamed = PrefixSource.artifact  # type: ignore[assignment,method-assign]
            try:
                runs.append(_open_row(name, *generate(worker, pid, n, query_pages), cold=True) | {
                    "query_pages": query_pages})
            finally:
                page_io.verify_pages, KVStore.artifact, PrefixSource.artifact_streamed = saved
        rows.append(_shown(_fastest(runs)))
    if "warm" in which:
        runs = []
        for _ in range(reps):  # a second query on a worker whose tier holds the prefix (a first query warmed it)
            worker = Worker(store, lm, progress=False, offload=blocking)
            generate(worker, pid, 1)
            runs.append(_open_row("host-warm: prefix in the host tier, summaries cached", *generate(worker, pid, n),
                                  cold=False))
        rows.append(_shown(_fastest(runs)))
    for r in rows:
        r["open_vs_before"] = r["open_s"] / rows[0]["open_s"]
        r["ttft_vs_before"] = r["ttft_s"] / rows[0]["ttft_s"]
    return rows, dropped


def _shown(row: dict) -> dict:
    """``row``, printed at once (a run stopped by a time limit keeps what it measured)."""
    print(f"  {row['name']}: open {row['open_s']:.3f} s (summaries {row['summaries_s']:.3f} s), time to first "
          f"token {row['ttft_s']:.3f} s, total {row['total_s']:.3f} s, SSD pages {row['ssd_pages']:.0f}; "
          + ", ".join(f"{k.removeprefix('offload_')} {row['stats'].get(k, 0.0):.3f}" for k in STEP_PARTS), flush=True)
    return row


def _fastest(runs: list[dict]) -> dict:
    """The run with the shortest time to first token; every run's tokens must agree."""
    best = min(runs, key=lambda r: r["ttft_s"])
    best["same_tokens_across_reps"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    return best


def read_then_hash(store: KVStore, prefix_id: str, name: str, *, manifest: Manifest | None = None) -> bytes:
    """``KVStore.artifact`` as before ``store.hashed_read``: the whole file read, then hashed (no overlap), as bytes
    (parsed by safetensors, a copy)."""
    m = manifest or store.manifest(prefix_id)
    index = next(i for i, a in enumerate(m.artifacts) if a.name == name)
    info = m.artifacts[index]
    with open(store.prefix_dir(prefix_id) / disk_record.artifact_file_name(index), "rb") as f:
        data = f.read(info.size + 1)
    if len(data) != info.size or digest(data) != info.blake2b:
        raise CorruptData(f"prefix {prefix_id}: artifact {name!r} failed its checksum")
    return data


def _open_row(name: str, st: GenerationStats, open_s: float, ttft: float, total: float, *, cold: bool) -> dict:
    x = st.extra
    return {"name": name, "cold": cold, "open_s": open_s, "ttft_s": ttft, "total_s": total, "steps": st.steps,
            "tokens": st.token_ids, "summaries_s": x.get("summaries_s", 0.0), "stats": dict(x),
            "ssd_pages": x.get("offload_ssd_pages", 0.0), "host_pages": x.get("offload_host_pages", 0.0),
            "device_plan_pages": x.get("offload_device_plan_pages", 0.0)}


# -- 4. SSD-only decode read rate ------------------------------------------------------------------
@contextlib.contextmanager
def kvikio_pool_of(threads: int | None) -> Iterator[None]:
    """With ``threads``: kvikio's I/O pool set to that many threads and the readers kept from raising it (the
    reader before it was raised to ``io_depth``); None: as the product runs."""
    if threads is None:
        yield
        return
    import kvikio.defaults

    saved_pool, saved_fn = kvikio.defaults.get("num_threads"), page_io.ensure_kvikio_threads
    kvikio.defaults.set("num_threads", threads)
    page_io.ensure_kvikio_threads = lambda kv, n: threads  # type: ignore[assignment]
    try:
        yield
    finally:
        page_io.ensure_kvikio_threads = saved_fn
        kvikio.defaults.set("num_threads", saved_pool)


def ssd_decode_section(store: KVStore, lm: LoadedModel, pid: str, base: OffloadConfig, n: int, drop: bool,
                       ceiling: dict) -> list[dict]:
    """Pages read from a cold disk by an SSD-only sparse generation of ``n`` tokens (no host tier warm-up):
    the read rate while reading (bytes over the time spent in page reads) against the random-read ceiling
    of the same page size measured above; one row per reader setting."""
    cfg = dataclasses.replace(base, warm_host_fraction=0.0)
    probe = page_io.open_page_reader(cfg.reader, cuda=torch.cuda.is_available(), depth=cfg.io_depth)
    reader = probe.name  # the reader a fetcher with this config opens
    probe.close()
    settings: list[tuple[str, int | None]] = []
    if reader == "kvikio":
        settings.append(("kvikio, its default pool of 1 thread (before)", 1))
    settings.append((f"{reader}, {cfg.io_depth} reads in flight (product)", None))
    rows = []
    for name, threads in settings:
        with kvikio_pool_of(threads):
            if drop:
                drop_os_cache()
            worker = Worker(store, lm, progress=False, offload=cfg)
            worker.host_tier()
            st, open_s, ttft, total = generate(worker, pid, n)
        x = st.extra
        nbytes, read_s = x.get("offload_bytes_ssd", 0.0), x.get("offload_ssd_read_s", 0.0)
        calls = x.get("offload_read_calls", 0.0)
        gbps = nbytes / read_s / 1e9 if read_s else 0.0
        rows.append({"name": name, "tokens": st.token_ids, "ssd_pages": x.get("offload_ssd_pages", 0.0),
                     "ssd_bytes": nbytes, "read_calls": calls, "ssd_read_s": read_s,
                     "verify_s": x.get("offload_verify_s", 0.0), "open_s": open_s, "ttft_s": ttft, "total_s": total,
                     "gbps_reading": gbps, "calls_per_s": calls / read_s if read_s else 0.0,
                     "gbps_whole": nbytes / (total - open_s) / 1e9 if total > open_s else 0.0,
                     "vs_ceiling": gbps / ceiling["gbps"] if ceiling["gbps"] else 0.0})
    return rows


# -- main ------------------------------------------------------------------------------------------
def build(args: argparse.Namespace, work: Path) -> tuple[LoadedModel, KVStore, str, float]:
    """The random-weight model, a store, and the saved document's prefix id; and prefill seconds."""
    if args.quick:
        spec = TinyLlamaSpec(hidden_size=512, intermediate_size=512, n_layers=args.layers, n_heads=4, n_kv_heads=4,
                             max_positions=args.ctx + 1024, init_range=0.02)
    else:
        spec = llama8b_attention_spec(args.layers, args.ctx + 1024)
    lm = load_random_model(spec, work)
    store = KVStore(StoreConfig(home=args.home or work / "home", page_size=16, fsync=False))
    t0 = time.perf_counter()
    pid = Worker(store, lm, progress=False, offload=None).prefill(document(args.ctx - 1)).prefix_id
    return lm, store, pid, time.perf_counter() - t0


def report(res: dict) -> None:
    """Print the tables of the sections that ran."""
    print(f"\ndevice: {res['device']}; CRC-32 implementation: {res['crc_impl']}; prefix {res['n_tokens']} tokens, "
          f"{res['kv_bytes'] / 1e9:.3f} GB of page files ({res['page_bytes']} B pages), prefill+write "
          f"{res['prefill_s']:.1f} s; OS page cache dropped before cold rows: {res['cache_dropped']}\n")
    if res["crc"]:
        print("| CRC verification | page bytes | GB/s | vs before (per page, 1 thread) |\n|---|---|---|---|")
        for r in res["crc"]:
            print(f"| {r['variant']} | {r['page_bytes']} | {r['gbps']:.2f} | {r['vs_before']:.2f} |")
    if res["reads"]:
        print("\n| random page reads in flight | reads | IOPS | GB/s | vs depth 1 |\n|---|---|---|---|---|")
        for r in res["reads"]:
            print(f"| {r['depth']} | {r['reads']} | {r['iops']:.0f} | {r['gbps']:.3f} | {r['vs_depth1']:.2f} |")
    if res["open"]:
        _report_open(res)
    if res["ssd_decode"]:
        c = res["ceiling"]
        print(f"\n| SSD-only decode, {res['ssd_tokens']} tokens, cold disk (reader) | SSD pages | read calls | GB read "
              "| s reading | GB/s while reading | vs random-read ceiling | read calls/s | GB/s over the decode |\n"
              + "|---" * 9 + "|")
        for r in res["ssd_decode"]:
            print(f"| {r['name']} | {r['ssd_pages']:.0f} | {r['read_calls']:.0f} | {r['ssd_bytes'] / 1e9:.3f} "
                  f"| {r['ssd_read_s']:.3f} | {r['gbps_reading']:.3f} | **{r['vs_ceiling']:.2f}** "
                  f"| {r['calls_per_s']:.0f} | {r['gbps_whole']:.3f} |")
        print(f"(ceiling: single-page random reads at {c['depth']} in flight above, {c['gbps']:.3f} GB/s, "
              f"{c['iops']:.0f} IOPS)")
    shared = [r for r in res["open"] if r.get("query_pages") == "shared"]
    print(f"\nall rows give identical tokens: {res['same_tokens']}"
          + "".join(f"; the shared-query row's tokens equal the others': {r['tokens'] == res['open'][0]['tokens']}"
                    for r in shared))


STEP_PARTS = ("offload_select_s", "offload_ssd_read_s", "offload_verify_s", "offload_sources_s", "offload_fetch_s",
              "offload_attend_s")
"""The fetch path's timers (summed over the generation's steps) shown per open row."""


def _report_open(res: dict) -> None:
    print(f"\n| open + first token ({res['tokens']} tokens, quest 2%) | open s | of which summaries s | vs first row "
          "| time to first token s | TTFT / prefill | vs first row | total s | SSD pages | host pages "
          "| device-planned pages |\n" + "|---" * 11 + "|")
    for r in res["open"]:
        print(f"| {r['name']} | {r['open_s']:.3f} | {r['summaries_s']:.3f} | {r['open_vs_before']:.3f} "
              f"| {r['ttft_s']:.3f} | {100 * r['ttft_s'] / res['prefill_s']:.1f} % | {r['ttft_vs_before']:.3f} "
              f"| {r['total_s']:.3f} | {r['ssd_pages']:.0f} | {r['host_pages']:.0f} | {r['device_plan_pages']:.0f} |")
    print("\n| the same rows: fetch-path seconds over the whole generation | "
          + " | ".join(k.removeprefix("offload_") for k in STEP_PARTS) + " |\n" + "|---" * (1 + len(STEP_PARTS)) + "|")
    for r in res["open"]:
        print(f"| {r['name']} | " + " | ".join(f"{r['stats'].get(k, 0.0):.3f}" for k in STEP_PARTS) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8, help="tokens generated per row")
    p.add_argument("--ssd-tokens", type=int, default=32, help="tokens of the SSD-only decode read-rate rows")
    p.add_argument("--reps", type=int, default=3, help="runs per open row (the fastest is reported)")
    p.add_argument("--crc-mb", type=int, default=256, help="bytes of pages per CRC measurement (MiB)")
    p.add_argument("--reads", type=int, default=20000, help="random page reads per depth")
    p.add_argument("--gpu-cache-mb", type=int, default=1024)
    p.add_argument("--host-cache-mb", type=int, default=16384)
    p.add_argument("--home", type=Path, default=None, help="store directory (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="small shape on the CPU (about a minute)")
    p.add_argument("--drop-cache", choices=("auto", "yes", "no"), default="auto",
                   help="drop the OS page cache before cold rows (root only; auto: not with --quick, a shared CPU)")
    p.add_argument("--sections", default="crc,reads,open,ssd",
                   help="which sections to run, comma-separated (ssd needs reads: its ceiling)")
    p.add_argument("--open-rows", default=",".join(OPEN_ROWS),
                   help=f"the open section's rows, comma-separated, of: {', '.join(OPEN_ROWS)}")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.open_rows = tuple(args.open_rows.split(","))
    if not set(args.open_rows) <= set(OPEN_ROWS):
        p.error(f"--open-rows: of {', '.join(OPEN_ROWS)}")
    args.sections = set(args.sections.split(","))
    if not args.sections <= SECTIONS or ("ssd" in args.sections and "reads" not in args.sections):
        p.error(f"--sections: a subset of {sorted(SECTIONS)}, with reads when ssd is in it")
    if args.quick:
        args.ctx, args.layers, args.tokens, args.crc_mb, args.reads, args.ssd_tokens = 4096, 4, 4, 32, 4000, 4
        args.gpu_cache_mb, args.host_cache_mb = 8, 512  # the CPU reference kernel converts whole pools
    drop = args.drop_cache == "yes" or (args.drop_cache == "auto" and not args.quick)
    same = [True]
    in_scratch_dir(lambda work: same.__setitem__(0, run(args, drop, work)), prefix="kvstash-open-")
    if not same[0]:
        sys.exit("rows disagree: how the prefix was opened changed the output")


def run(args: argparse.Namespace, drop: bool, work: Path) -> bool:
    """Every section over one saved prefix in ``work``; prints the tables; whether every row gave the same
    tokens."""
    lm, store, pid, prefill_s = build(args, work)
    m = store.manifest(pid)
    base = OffloadConfig(gpu_cache_bytes=args.gpu_cache_mb << 20, host_cache_bytes=args.host_cache_mb << 20,
                         warm_host_fraction=1.0)
    print(f"prefix {m.n_tokens} tokens saved in {prefill_s:.1f} s", flush=True)
    crc, reads, opened, ssd, ceiling, dropped, dropped2 = [], [], [], [], {}, drop, drop
    if "crc" in args.sections:
        crc = crc_section(sorted({m.layout.page_bytes, 8192}), args.crc_mb << 20, base.io_threads)
        print("CRC done", flush=True)
    if "reads" in args.sections:
        reads, dropped = read_section(store, pid, sorted({1, 4, base.io_depth, 2 * base.io_depth}), args.reads,
                                      drop)
        ceiling = max(reads, key=lambda r: r["gbps"])
        print("reads done", flush=True)
    if "open" in args.sections:
        opened, dropped2 = open_section(store, lm, pid, base, args.tokens, drop, args.reps, args.open_rows)
        print("open done", flush=True)
    if "ssd" in args.sections:
        ssd = ssd_decode_section(store, lm, pid, base, args.ssd_tokens, drop, ceiling)
        print("SSD decode done", flush=True)
    # A shared query selection attends other pages: its tokens may differ (reported apart, not checked).
    same = all(r["tokens"] == opened[0]["tokens"] and r["same_tokens_across_reps"] for r in opened
               if r.get("query_pages", "token") == "token")
    same = same and all(r["tokens"] == ssd[0]["tokens"] for r in ssd)
    if opened and ssd:
        same = same and ssd[0]["tokens"][:len(opened[0]["tokens"])] == opened[0]["tokens"]
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "crc_impl": CRC32_IMPL,
           "n_tokens": m.n_tokens, "kv_bytes": sum(f.size for f in m.files), "page_bytes": m.layout.page_bytes,
           "prefill_s": prefill_s, "cache_dropped": dropped and dropped2, "tokens": args.tokens,
           "crc": crc, "reads": reads, "open": opened, "ceiling": ceiling, "ssd_tokens": args.ssd_tokens,
           "ssd_decode": ssd, "same_tokens": same}
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    store.close()
    return same


if __name__ == "__main__":
    main()
