"""Launcher of Double-P's CPU bookkeeping kernel (``kernel.cpp``).

``doublep_select`` gives, from a step's stage-1 masses, what ``DoublePSelector.select`` needs, with the same bits
as its numpy / torch forms (``doublep_select_ref``): the ranking, the cumulative mass (its totals stay torch's
sum, between the kernel's two calls), the two top-p prefixes, the budgeted stage 2, the exact clusters' sorted
token ids and the approximated clusters' ids, each row in two loops instead of some forty small array ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import torch

from workers.kernels.index_page_mass.build import CpuKernelBuild, build

from .types import DoublePPick

__all__ = ["cpu_kernel_available", "doublep_select"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")
_LOCK = threading.Lock()


def _config() -> CpuKernelBuild:
    # the same floating-point operations as torch / numpy, in the same order: no fused multiply-adds
    base = CpuKernelBuild()
    return CpuKernelBuild(compiler=base.compiler, flags=(*base.flags, "-ffp-contract=off"), cache_dir=base.cache_dir,
                          enabled=base.enabled)


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> tuple[Any, Any] | None:
    config = config or _config()
    if not config.enabled:
        log.info("CPU kernels disabled (KVSTASH_CPU_KERNEL=0): Double-P keeps its numpy bookkeeping on the CPU")
        return None
    with _LOCK:
        try:
            lib = ctypes.CDLL(str(build(config, source=SOURCE, name="doublep_select")))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("CPU Double-P kernel unavailable (%s): Double-P keeps its numpy bookkeeping on the CPU", e)
            return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    rank, select = lib.kvstash_dp_rank, lib.kvstash_dp_select
    rank.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
    rank.restype = ctypes.c_int
    select.argtypes = [ptr] * 8 + [i64] * 4 + [ctypes.c_double] * 2 + [i64] * 3 + [ptr, i64] + [ptr] * 4
    select.restype = ctypes.c_int
    return rank, select


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


def doublep_select(mass: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor, nonempty: torch.Tensor,
                   perm: torch.Tensor, *, p1: float, p2: float, budget: int | None, groups: int, pad: int,
                   fallback: bool, exact_all: bool = False) -> DoublePPick:
    """One step's picks from its stage-1 masses ``mass [R, C]`` (float32, non-negative; rows (query token, KV
    head), heads fastest, ``groups`` query tokens). Per KV head: ``sizes [Hkv, C]`` int64 cluster sizes,
    ``starts [Hkv, C]`` int64 each cluster's first position in ``perm`` (int32, the cluster-ordered token ids of
    every head, flat), ``nonempty [Hkv, C]`` bool. Stage 1 keeps the top-``p1`` prefix of each row's ranking,
    stage 2 the top-``p2`` one (within stage 1); with ``budget`` (exact tokens per group of rows) the stage-2
    threshold shared by a group is lowered until its tokens fit; ``exact_all``: every cluster exact (no top-p).
    Tokens are padded with ``pad``; ``fallback``: also the approximated clusters (stage 1 but not stage 2,
    nonempty)."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError("the CPU Double-P kernel is unavailable (see the log); use doublep_select_ref")
    rank, select = loaded
    r, c = mass.shape
    hkv = sizes.shape[0]
    if mass.device.type != "cpu" or mass.dtype != torch.float32 or r % hkv or r % groups or sizes.shape[1] != c:
        raise ValueError(f"bad Double-P kernel input: mass {tuple(mass.shape)} {mass.dtype}, sizes "
                         f"{tuple(sizes.shape)}, groups {groups}")
    for x, dt in ((sizes, torch.int64), (starts, torch.int64), (nonempty, torch.bool), (perm, torch.int32)):
        if x.dtype != dt or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"Double-P kernel input must be contiguous CPU {dt}, got {x.dtype}")
    mass = mass.contiguous()
    order = torch.empty(r, c, dtype=torch.int64)
    m = torch.empty(r, c, dtype=torch.float64)
    csum = torch.empty(r, c, dtype=torch.float64)
    rank(mass.data_ptr(), r, c, order.data_ptr(), m.data_ptr(), csum.data_ptr())
    total = None if exact_all else m.sum(-1).clamp_min_(1e-300)  # torch's sum: the totals' bits as before
    n_mid = perm.numel() // hkv
    tok_cap = r * n_mid
    tokens = torch.empty(tok_cap, dtype=torch.int64)
    counts = torch.empty(r, dtype=torch.int64)
    cids = torch.empty(r * c if fallback else 0, dtype=torch.int64)
    ccounts = torch.empty(r if fallback else 0, dtype=torch.int64)
    info = torch.zeros(5, dtype=torch.int64)
    rc = select(order.data_ptr(), m.data_ptr(), csum.data_ptr(), 0 if total is None else total.data_ptr(),
                sizes.data_ptr(), starts.data_ptr(), nonempty.data_ptr(), perm.data_ptr(), r, hkv, c, groups,
                ctypes.c_double(p1), ctypes.c_double(p2), -1 if budget is None else budget, pad, int(fallback),
                tokens.data_ptr(), tok_cap, counts.data_ptr(), cids.data_ptr(), ccounts.data_ptr(), info.data_ptr())
    if rc:
        raise ValueError(f"the CPU Double-P kernel refused its input (code {rc})")
    width, n_ids, n_exact, cwidth, n_approx = info.tolist()
    pick = DoublePPick(tokens=tokens[:r * width].view(r, width), counts=counts, n_ids=n_ids, n_exact=n_exact)
    if not fallback:
        return pick
    return DoublePPick(tokens=pick.tokens, counts=counts, n_ids=n_ids, n_exact=n_exact,
                       centroids=cids[:r * cwidth].view(r, cwidth), n_centroids=ccounts, n_approx=n_approx)
