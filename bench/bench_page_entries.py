"""A single decode row's page entries on one GPU: ``page_entries`` (one launch) against the torch glue it replaced.

The torch glue is what ``SparsePrefixAttention._attend_pages`` ran per layer for one row before the kernel:
the kernel's torch reference (``page_entries_ref``: the page step's entry tokens, bias, pool rows, clamps and
mid count) and ``torch.full`` of the counts (~15 small kernels). Both are captured in a CUDA
graph, as a decode step runs them, and the graph replayed back to back: the time per replay is mostly
launches. Shapes: Llama-3.1-8B's 8 KV heads, 16-token pages, sink 4 and tail 64 anchors, ``budget`` of the
context picked. Both results are checked equal first.

Usage: ``python bench/bench_page_entries.py [--contexts 32768 131072] [--budget 0.05]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.kernels.page_entries import page_entries, page_entries_ref  # noqa: E402
from workers.methods.page_step import PagePlan, page_plan  # noqa: E402

HKV, PAGE, SINK, TAIL = 8, 16, 4, 64


def graph_us(fn: Callable[[], tuple[torch.Tensor, ...]], reps: int = 2000) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Microseconds per replay of ``fn`` captured in a CUDA graph, and its outputs after a replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps * 1e3, out


def case(n_tokens: int, budget: float, dev: torch.device) -> tuple[PagePlan, torch.Tensor, torch.Tensor, int]:
    """A plan, picked pages ``[Hkv, n]`` in random order, first pool rows of the fetched pages, pool rows."""
    lo, hi = SINK, n_tokens - TAIL
    plan = page_plan(anchors=torch.cat([torch.arange(0, lo), torch.arange(hi, n_tokens)]).to(dev), lo=lo, hi=hi,
                     page_size=PAGE, k=int(budget * n_tokens), n_heads=HKV)
    n, na = plan.n_pages, plan.anchor_pages.shape[1]
    picked = torch.stack([torch.randperm(plan.end_page - plan.first_page, device=dev)[:n]
                          for _ in range(HKV)]) + plan.first_page
    first = torch.stack([torch.randperm(2 * (n + na), device=dev)[: n + na] for _ in range(HKV)]) * PAGE
    return plan, picked, first, 2 * (n + na) * PAGE


def compare(n_tokens: int, budget: float, dev: torch.device) -> None:
    """Time both paths at one context and print them (after checking their results equal)."""
    plan, picked, first, pool_rows = case(n_tokens, budget, dev)
    lo, hi, n_picked = plan.lo, plan.hi, plan.n_pages * PAGE

    def glue() -> tuple[torch.Tensor, ...]:
        torch.full((1, HKV), n_picked, device=dev)
        e = page_entries_ref(picked, first, plan.anchor_slot, plan.anchor_offset, page_size=PAGE, lo=lo, hi=hi,
                             pool_rows=pool_rows)
        return e.rows, e.bias, e.tokens, e.n_distinct

    def kernel() -> tuple[torch.Tensor, ...]:
        e = page_entries(picked, first, plan.anchor_slot, plan.anchor_offset, page_size=PAGE, lo=lo, hi=hi,
                         pool_rows=pool_rows)
        return e.rows, e.bias, e.tokens, e.n_distinct

    t_glue, ref = graph_us(glue)
    t_kernel, out = graph_us(kernel)
    assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True)), "kernel != torch glue"
    print(f"context {n_tokens:>7}: {plan.n_pages} pages/head, torch glue {t_glue:6.2f} us, "
          f"page_entries {t_kernel:6.2f} us per graph replay ({t_glue / t_kernel:.1f}x faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--budget", type=float, default=0.05)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; Hkv={HKV}, page {PAGE}, anchors {SINK}+{TAIL}, budget {args.budget}")
    for n_tokens in args.contexts:
        compare(n_tokens, args.budget, dev)


if __name__ == "__main__":
    main()
