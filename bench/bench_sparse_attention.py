"""Sparse decode attention kernel vs torch SDPA on one GPU: ratios measured side by side.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, D=128, bf16), one decode
token per sequence. For each context (32k, 128k) and batch (1, 8), and n = 1%, 2%, 5%
of the context plus 4 sink + 16 tail tokens, it times in one process:

- ``idx``    the kernel over n entries gathered through ``idx`` from the full buffer,
- ``contig`` the kernel over the same n entries stored contiguously,
- ``sdpa_n`` torch SDPA over the same n contiguous entries,
- ``sdpa_full`` torch SDPA over the whole context,
- ``gather+sdpa`` torch.gather of the n entries then SDPA (what one does without the kernel),
- a device-to-device copy, whose bandwidth (bytes read + written) is the ceiling that
  the kernel's achieved K/V bandwidth is compared with.

SDPA is timed in two equivalent forms (``enable_gqa=True`` with q ``[B, 32, 1, D]``, and
q regrouped as ``[B, 8, 4, D]`` so the 4 heads of a group are 4 query rows); the faster
is used. Every timing is the median over repetitions, each preceded by a 256 MiB write
that evicts L2 and a GPU sleep so host launch overhead stays off the clock (host-side
launch cost is reported separately). Only ratios are meant for comparison.

Usage: ``python bench/bench_sparse_attention.py [--sweep] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from workers.kernels.sparse_attention import choose_num_splits, sparse_decode_attention
from workers.kernels.sparse_attention.ops import _launch

DEV = "cuda"  # --dry-run: "cpu" with TRITON_INTERPRET=1 and tiny sizes, to check the script itself
HQ, HKV, D = 32, 8, 128
SINK, TAIL = 4, 16
DTYPE = torch.bfloat16


class Timer:
    """Median GPU time of ``fn`` with L2 flushed and launch overhead hidden by a GPU sleep."""

    def __init__(self, reps: int = 100, warmup: int = 10, sleep_cycles: int = 1_000_000):
        self.reps, self.warmup, self.sleep_cycles = reps, warmup, sleep_cycles
        self.flush = torch.empty(256 << 20 if DEV == "cuda" else 1, dtype=torch.int8, device=DEV)

    def __call__(self, fn) -> float:
        if DEV != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        for _ in range(self.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            torch.cuda._sleep(self.sleep_cycles)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return times[len(times) // 2]  # microseconds


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    x = torch.empty(1 << 30 if DEV == "cuda" else 1 << 10, dtype=torch.int8, device=DEV).random_(-128, 127)
    y = torch.empty_like(x)
    t = timer(lambda: y.copy_(x))
    return 2 * x.numel() / (t * 1e-6) / 1e9


def make_idx(B: int, ctx: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[B, HKV, n] int32: sink + tail + a sorted random sample of the middle, per head."""
    mid = n - SINK - TAIL
    keys = torch.rand(B * HKV, ctx - SINK - TAIL, device=DEV, generator=gen)
    picked = keys.topk(mid, dim=1).indices.sort(dim=1).values + SINK
    sink = torch.arange(SINK, device=DEV).expand(B * HKV, SINK)
    tail = torch.arange(ctx - TAIL, ctx, device=DEV).expand(B * HKV, TAIL)
    return torch.cat([sink, picked, tail], dim=1).to(torch.int32).view(B, HKV, n)


def sdpa_forms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The two equivalent SDPA decode formulations (GQA flag; 4 heads regrouped as 4 rows)."""
    B = q.shape[0]
    q_gqa = q.view(B, HQ, 1, D)
    q_grp = q.view(B, HKV, HQ // HKV, D)
    return {
        "gqa": lambda: F.scaled_dot_product_attention(q_gqa, k, v, enable_gqa=True),
        "grouped": lambda: F.scaled_dot_product_attention(q_grp, k, v),
    }


def best_sdpa(timer: Timer, q, k, v) -> tuple[float, str]:
    times = {name: timer(fn) for name, fn in sdpa_forms(q, k, v).items()}
    name = min(times, key=times.__getitem__)
    return times[name], name


def host_launch_us(fn, calls: int = 200) -> float:
    """Host time per call (enqueue only), after a synchronize."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def sweep_splits(timer: Timer, q, k, v, idx, scale) -> dict[str, float]:
    """Kernel time around the heuristic: splits x {1/2, 1, 2}, BLOCK_N 64/128, and warps/stages."""
    B, n = q.shape[0], idx.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, HQ, device=DEV, dtype=torch.float32)
    s0 = choose_num_splits(B, HKV, n, q.device)
    variants = [(bn, s, 4, 2) for bn in (64, 128) for s in sorted({max(1, s0 // 2), s0, min(64, 2 * s0)})]
    variants += [(128, s0, 8, 2), (128, s0, 4, 3)]
    res = {}
    for bn, splits, warps, stages in variants:
        if splits > math.ceil(n / bn):
            continue

        def fn(s=splits, bn=bn, w=warps, st=stages):
            _launch(q, k, v, scale, idx, None, None, None, None, out, lse, n, s, block_n=bn, num_warps=w, num_stages=st)

        res[f"s{splits}/b{bn}/w{warps}/st{stages}"] = timer(fn)
    return res


def graph_check(timer: Timer) -> dict:
    """Capture the launcher in a CUDA graph (as a decode engine would), replay, compare, time."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    B, ctx, n = 1, 32768, 348
    k = torch.randn(B, HKV, ctx, D, device=DEV, dtype=DTYPE, generator=gen)
    q = torch.randn(B, HQ, D, device=DEV, dtype=DTYPE, generator=gen)
    idx = make_idx(B, ctx, n, gen)
    eager = sparse_decode_attention(q, k, k, scale=0.088, idx=idx)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_decode_attention(q, k, k, scale=0.088, idx=idx)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, _ = sparse_decode_attention(q, k, k, scale=0.088, idx=idx)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out_g, eager)
    t_graph = timer(graph.replay)
    t_eager = timer(lambda: sparse_decode_attention(q, k, k, scale=0.088, idx=idx))
    return dict(graph_equal=same, graph_us=t_graph, eager_us=t_eager)


def run_fraction(timer, q, k, v, frac, t_full, bw, sweep, gen) -> dict:
    """Time the kernel and SDPA over n = frac * ctx + sink + tail entries of the buffer (k, v)."""
    B, ctx = k.shape[0], k.shape[2]
    scale = 1.0 / math.sqrt(D)
    n = round(frac * ctx) + SINK + TAIL
    idx = make_idx(B, ctx, n, gen)
    gidx = idx.long().unsqueeze(-1).expand(B, HKV, n, D)
    kc, vc = torch.gather(k, 2, gidx).contiguous(), torch.gather(v, 2, gidx).contiguous()
    q_grp = q.view(B, HKV, HQ // HKV, D)
    t_idx = timer(lambda: sparse_decode_attention(q, k, v, scale=scale, idx=idx))
    t_contig = timer(lambda: sparse_decode_attention(q, kc, vc, scale=scale))
    t_sdpa, form = best_sdpa(timer, q, kc, vc)
    t_gs = timer(lambda: F.scaled_dot_product_attention(q_grp, torch.gather(k, 2, gidx), torch.gather(v, 2, gidx)))
    out_idx = sparse_decode_attention(q, k, v, scale=scale, idx=idx)[0].float()
    ref = sdpa_forms(q, kc, vc)["gqa"]().view(B, HQ, D).float()
    kv_bytes = 2 * B * HKV * n * D * 2 + B * HKV * n * 4  # K + V rows (bf16) + int32 indices
    row = dict(ctx=ctx, B=B, frac=frac, n=n, splits=choose_num_splits(B, HKV, n, q.device))
    row.update(idx_us=t_idx, contig_us=t_contig, sdpa_n_us=t_sdpa, sdpa_n_form=form, sdpa_full_us=t_full)
    row.update(gather_sdpa_us=t_gs, gbs=kv_bytes / (t_idx * 1e-6) / 1e9, copy_gbs=bw)
    row.update(max_err=(out_idx - ref).abs().max().item())
    if sweep:
        sw = sweep_splits(timer, q, k, v, idx, scale)
        best = min(sw, key=sw.__getitem__)
        row.update(sweep=sw, best=best, best_us=sw[best])
    return row


def run_config(timer, ctx, B, fracs, bw, sweep, gen, rows, log) -> None:
    """Full-context SDPA and kernel once, then every fraction, for one (context, batch)."""
    scale = 1.0 / math.sqrt(D)
    k = torch.randn(B, HKV, ctx, D, device=DEV, dtype=DTYPE, generator=gen)
    v = torch.randn(B, HKV, ctx, D, device=DEV, dtype=DTYPE, generator=gen)
    q = torch.randn(B, HQ, D, device=DEV, dtype=DTYPE, generator=gen)
    t_full, full_form = best_sdpa(timer, q, k, v)
    t_kfull = timer(lambda: sparse_decode_attention(q, k, v, scale=scale))
    ref_full = sdpa_forms(q, k, v)["gqa"]().view(B, HQ, D).float()
    err_full = (sparse_decode_attention(q, k, v, scale=scale)[0].float() - ref_full).abs().max().item()
    log.append(dict(ctx=ctx, B=B, sdpa_full_us=t_full, sdpa_form=full_form, kernel_full_us=t_kfull, max_err=err_full))
    print(
        f"ctx={ctx} B={B}: SDPA full {t_full:.1f} us ({full_form}); kernel full {t_kfull:.1f} us "
        f"(x{t_kfull / t_full:.2f}); max|kernel-SDPA| {err_full:.2e}",
        flush=True,
    )
    for frac in fracs:
        row = run_fraction(timer, q, k, v, frac, t_full, bw, sweep, gen)
        rows.append(row)
        short = {key: (round(x, 2) if isinstance(x, float) else x) for key, x in row.items() if key != "sweep"}
        print(json.dumps(short), flush=True)
    if DEV == "cuda":
        torch.cuda.empty_cache()


def print_table(rows, bw):
    print(f"\ndevice-to-device copy: {bw:.0f} GB/s (read+write)")
    head = (
        "| ctx | B | n (% ctx) | splits | idx / SDPA-n | contig / SDPA-n | idx / SDPA-full | "
        "gather+SDPA / idx | idx GB/s (% copy) | heuristic / best split | max err |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for r in rows:
        best = f"{r['idx_us'] / r['best_us']:.2f} ({r['best']})" if "best" in r else "-"
        print(
            f"| {r['ctx'] // 1024}k | {r['B']} | {r['n']} ({100 * r['frac']:.0f}%+20) | {r['splits']} | "
            f"{r['idx_us'] / r['sdpa_n_us']:.2f} | {r['contig_us'] / r['sdpa_n_us']:.2f} | "
            f"{r['idx_us'] / r['sdpa_full_us']:.3f} | {r['gather_sdpa_us'] / r['idx_us']:.2f} | "
            f"{r['gbs']:.0f} ({100 * r['gbs'] / bw:.0f}%) | {best} | {r['max_err']:.1e} |"
        )
    print("\nabsolute medians (us), for reference only:")
    for r in rows:
        print(
            f"  ctx={r['ctx']} B={r['B']} n={r['n']}: idx {r['idx_us']:.1f}, contig {r['contig_us']:.1f}, "
            f"SDPA-n {r['sdpa_n_us']:.1f} ({r['sdpa_n_form']}), SDPA-full {r['sdpa_full_us']:.1f}, "
            f"gather+SDPA {r['gather_sdpa_us']:.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    ap.add_argument("--sweep", action="store_true", help="also time num_splits x BLOCK_N variants")
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny sizes: checks the script only")
    args = ap.parse_args()
    global DEV
    if args.dry_run:
        DEV = "cpu"
        args.contexts, args.batches = [2048], [1]
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}", flush=True)
    timer = Timer()
    bw = copy_bandwidth(timer)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows: list[dict] = []
    log: list[dict] = []
    for ctx in args.contexts:
        for B in args.batches:
            run_config(timer, ctx, B, args.fractions, bw, args.sweep, gen, rows, log)
    q = torch.randn(1, HQ, D, device=DEV, dtype=DTYPE)
    kc = torch.randn(1, HKV, 348, D, device=DEV, dtype=DTYPE)
    calls = 200 if DEV == "cuda" else 2
    out, lse = torch.empty_like(q), torch.empty(1, HQ, device=DEV)
    host_k = host_launch_us(lambda: sparse_decode_attention(q, kc, kc, scale=0.088), calls)
    host_l = host_launch_us(lambda: _launch(q, kc, kc, 0.088, None, None, None, None, None, out, lse, 348, 3), calls)
    host_s = host_launch_us(sdpa_forms(q, kc, kc)["grouped"], calls)
    print(
        f"\nhost cost per call (n=348, B=1, 3 splits = 2 launches): public API {host_k:.1f} us, "
        f"triton launches alone {host_l:.1f} us, SDPA {host_s:.1f} us"
    )
    graph = graph_check(timer) if DEV == "cuda" else {}
    print(f"CUDA graph capture of the launcher: {graph}")
    print_table(rows, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    copy_gbs=bw,
                    rows=rows,
                    full=log,
                    host_us=dict(kernel=host_k, launch_only=host_l, sdpa=host_s),
                    graph=graph,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
