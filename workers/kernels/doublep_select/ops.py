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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from native.build import CpuKernelBuild, load_library

from .types import DoublePPick

__all__ = ["DoublePKernel", "cpu_kernel_available", "doublep_select"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernel.cpp")


def _config() -> CpuKernelBuild:
    # the same floating-point operations as torch / numpy, in the same order: no fused multiply-adds
    base = CpuKernelBuild()
    return CpuKernelBuild(compiler=base.compiler, flags=(*base.flags, "-ffp-contract=off"), cache_dir=base.cache_dir,
                          enabled=base.enabled)


@dataclass(frozen=True)
class _Loaded:
    rank: Any
    select: Any
    pick: Any
    sum_width: int | None
    """Lanes with which the kernel's row sum gives torch.sum's bits here (None: none did; totals stay torch's)."""
    torch_sum: Any
    """``kvstash_dp_torch_sum(ptr, n, lanes)``: the kernel's row sum alone (its check, and the tests')."""


SUM_SERIAL_NUMEL = 32768
"""torch reduces smaller inputs on one thread (ATen's grain size): below it, or with one torch thread, its row sums
are the serial cascade the kernel repeats."""


def _sum_width(torch_sum: Any) -> int | None:
    """The lane count with which ``kvstash_dp_torch_sum`` equals ``torch.sum`` of float64 rows, bit for bit, over
    lengths that cross every branch of ATen's cascade (checked once per process), else None."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.rand(2, n, generator=gen, dtype=torch.float64).pow_(8) for n in
            (*range(1, 70), 127, 255, 256, 257, 507, 1000, 1023, 2048, 4097, 10001)]
    for width in (4, 8, 2, 1):
        if all(torch_sum(x[i].data_ptr(), x.shape[1], width) == want
               for x in rows for i, want in enumerate(x.sum(-1).tolist())):
            return width
    log.info("the CPU Double-P kernel's row sum matches no torch.sum here: the totals stay torch's")
    return None


@functools.cache
def _load(config: CpuKernelBuild | None = None) -> _Loaded | None:
    lib = load_library(config or _config(), source=SOURCE, name="doublep_select",
                       fallback="Double-P keeps its numpy bookkeeping on the CPU")
    if lib is None:
        return None
    i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    rank, select, pick = lib.kvstash_dp_rank, lib.kvstash_dp_select, lib.kvstash_dp_pick
    rank.argtypes = [ptr, i64, i64, ptr, ptr]
    rank.restype = ctypes.c_int
    tail: list[Any] = [i64] * 4 + [f64] * 2 + [i64] * 3 + [ptr, i64] + [ptr] * 4  # rows .. info
    select.argtypes = [ptr] * 7 + tail
    select.restype = ctypes.c_int
    head: list[Any] = [ptr, i64, i64]
    pick.argtypes = head + [ptr] * 4 + tail
    pick.restype = ctypes.c_int
    torch_sum = lib.kvstash_dp_torch_sum
    torch_sum.argtypes = [ptr, i64, i64]
    torch_sum.restype = f64
    return _Loaded(rank, select, pick, _sum_width(torch_sum), torch_sum)


def _torch_sum() -> Any:
    """The kernel's row sum (``kvstash_dp_torch_sum``), for tests."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError("the CPU Double-P kernel is unavailable")
    return loaded.torch_sum


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return _load() is not None


class DoublePKernel:
    """A layer's per-generation constants for the kernel (checked and held once, not per step): per KV head,
    ``sizes [Hkv, C]`` int64 cluster sizes, ``starts [Hkv, C]`` int64 each cluster's first position in ``perm``
    (int32, the cluster-ordered token ids of every head, flat), ``nonempty [Hkv, C]`` bool."""

    def __init__(self, sizes: torch.Tensor, starts: torch.Tensor, nonempty: torch.Tensor, perm: torch.Tensor):
        loaded = _load()
        if loaded is None:
            raise RuntimeError("the CPU Double-P kernel is unavailable (see the log); use doublep_select_ref")
        self._lib = loaded
        for x, dt in ((sizes, torch.int64), (starts, torch.int64), (nonempty, torch.bool), (perm, torch.int32)):
            if x.dtype != dt or not x.is_contiguous() or x.device.type != "cpu":
                raise ValueError(f"Double-P kernel input must be contiguous CPU {dt}, got {x.dtype}")
        if sizes.dim() != 2 or starts.shape != sizes.shape or nonempty.shape != sizes.shape:
            raise ValueError(f"sizes {tuple(sizes.shape)}, starts {tuple(starts.shape)}, nonempty "
                             f"{tuple(nonempty.shape)} must be one [Hkv, C] shape")
        self.hkv, self.c = sizes.shape
        self.n_mid = perm.numel() // self.hkv if self.hkv else 0
        if sizes.numel() and (bool((sizes < 0).any()) or int((starts + sizes).max()) > perm.numel()
                              or int(starts.min()) < 0 or perm.numel() >= 2 ** 31):
            raise ValueError("Double-P kernel: clusters must lie inside perm (fewer than 2^31 ids)")
        # int32 copies: half the bytes a step reads cold (a step's other work evicts them between layers)
        self._held = (sizes.int(), starts.int(), nonempty, perm)  # the pointers below stay valid while these live
        self._ptrs = tuple(x.data_ptr() for x in self._held)

    def pick(self, mass: torch.Tensor, *, p1: float, p2: float, budget: int | None, groups: int, pad: int,
             fallback: bool, exact_all: bool = False) -> DoublePPick:
        """One step's picks from its stage-1 masses ``mass [R, C]`` (float32, non-negative; rows (query token, KV
        head), heads fastest, ``groups`` query tokens). Stage 1 keeps the top-``p1`` prefix of each row's ranking,
        stage 2 the top-``p2`` one (within stage 1); with ``budget`` (exact tokens per group of rows) the stage-2
        threshold shared by a group is lowered until its tokens fit; ``exact_all``: every cluster exact (no
        top-p). Tokens are padded with ``pad``; ``fallback``: also the approximated clusters (stage 1 but not
        stage 2, nonempty)."""
        r, c = mass.shape
        hkv = self.hkv
        if mass.device.type != "cpu" or mass.dtype != torch.float32 or r % hkv or r % groups or c != self.c:
            raise ValueError(f"bad Double-P kernel input: mass {tuple(mass.shape)} {mass.dtype}, {hkv} heads of "
                             f"{self.c} clusters, groups {groups}")
        mass = mass.contiguous()
        # a row's exact tokens: at most the mid region, and within a budget at most the budget (its group's sum fits)
        tok_cap = r * (self.n_mid if budget is None or exact_all else min(self.n_mid, max(budget, 0)))
        n_cids = r * c if fallback else 0
        # one int64 buffer: tokens, counts, centroid ids, centroid counts, info
        buf = torch.empty(tok_cap + 2 * r + n_cids + 5, dtype=torch.int64)
        at = buf.data_ptr()
        args = (*self._ptrs, r, hkv, c, groups, p1, p2, -1 if budget is None else budget, pad, int(fallback), at,
                tok_cap, at + 8 * tok_cap, at + 8 * (tok_cap + r), at + 8 * (tok_cap + r + n_cids),
                at + 8 * (tok_cap + 2 * r + n_cids))
        lib = self._lib
        if lib.sum_width is not None and (r * c < SUM_SERIAL_NUMEL or torch.get_num_threads() == 1):
            # one call: the totals are torch's row sums of the ranked masses, made in the kernel with its bits
            rc = lib.pick(mass.data_ptr(), lib.sum_width, int(exact_all), *args)
        else:
            order, m = torch.empty(r, c, dtype=torch.int32), torch.empty(r, c, dtype=torch.float64)
            lib.rank(mass.data_ptr(), r, c, order.data_ptr(), m.data_ptr())
            total = None if exact_all else m.sum(-1).clamp_min_(1e-300)  # torch's sum: the totals' bits as before
            rc = lib.select(order.data_ptr(), m.data_ptr(), 0 if total is None else total.data_ptr(), *args)
        if rc:
            raise ValueError(f"the CPU Double-P kernel refused its input (code {rc})")
        width, n_ids, n_exact, cwidth, n_approx = buf[-5:].tolist()
        tokens, counts = buf[:r * width].view(r, width), buf[tok_cap:tok_cap + r]
        if not fallback:
            return DoublePPick(tokens=tokens, counts=counts, n_ids=n_ids, n_exact=n_exact)
        cids = buf[tok_cap + r:tok_cap + r + r * cwidth].view(r, cwidth)
        return DoublePPick(tokens=tokens, counts=counts, n_ids=n_ids, n_exact=n_exact, centroids=cids,
                           n_centroids=buf[tok_cap + r + n_cids:tok_cap + 2 * r + n_cids], n_approx=n_approx)


def doublep_select(mass: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor, nonempty: torch.Tensor,
                   perm: torch.Tensor, *, p1: float, p2: float, budget: int | None, groups: int, pad: int,
                   fallback: bool, exact_all: bool = False) -> DoublePPick:
    """``DoublePKernel(sizes, starts, nonempty, perm).pick(mass, ...)``: one step's picks (see there)."""
    return DoublePKernel(sizes, starts, nonempty, perm).pick(mass, p1=p1, p2=p2, budget=budget, groups=groups,
                                                             pad=pad, fallback=fallback, exact_all=exact_all)
