"""Single-row page entries: the Triton kernel == its torch reference == the page step's torch functions, bit for bit.

The Triton kernel runs in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU) or on
CUDA. Outputs the launcher allocates are poisoned first, so an entry the kernel does not write fails. The
page step's functions (``entry_tokens``, ``entry_bias``, the pool rows of the picked pages and anchors, then
the clamps and the mid count) are what ``SparsePrefixAttention._attend_pages`` ran for a single row before
the kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

import workers.kernels.page_entries.ops as pe_ops
from workers.kernels.page_entries import PageEntries, PageEntriesConfig, page_entries, page_entries_ref
from workers.kernels.page_entries.cpu import cpu_kernel_available, page_entries_cpu
from workers.methods.layer_kv import page_tokens
from workers.methods.page_step import PagePlan, entry_bias, entry_tokens, page_plan
from workers.pages import page_span

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
POISON = -7  # no output entry takes this value (rows >= 0, bias 0 or -inf, tokens >= lo >= 0)


@pytest.fixture()
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs the launcher allocates start as POISON, so an entry the kernel does not write fails."""
    real = pe_ops._empty

    def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return real(*shape, dtype=dtype, device=device).fill_(POISON)

    monkeypatch.setattr(pe_ops, "_empty", empty)


def _case(hkv: int, n: int, p: int, sink: int, tail: int, seed: int
          ) -> tuple[PagePlan, torch.Tensor, torch.Tensor, int]:
    """A layer whose mid region starts and ends inside pages, ``n`` picked pages per head in random order
    (head 0 holds both boundary pages), first pool rows with some -1 (rejected ids) and some past the pool
    (head 0's first and last page).

    Returns the plan, ``picked [Hkv, n]``, ``first_rows [Hkv, n + na]`` and the pool's row count.
    """
    g = torch.Generator().manual_seed(seed)
    n_tokens = sink + tail + p * (n + 2) + 7 if sink + tail else p * (n + 2) + 7
    lo, hi = sink, n_tokens - tail
    plan = page_plan(anchors=torch.cat([torch.arange(0, lo), torch.arange(hi, n_tokens)]), lo=lo, hi=hi,
                     page_size=p, k=n * p, n_heads=hkv)
    assert plan.n_pages == n and (lo % p or hi % p)
    first, end = page_span(lo, hi, p)
    heads = [first + torch.randperm(end - first, generator=g)[:n] for _ in range(hkv)]
    if n >= 2:  # both boundary pages, partly outside the mid region
        heads[0][:2] = torch.tensor([end - 1, first])
        heads[0] = heads[0][torch.randperm(n, generator=g)]
    elif n == 1:
        heads[0][0] = end - 1
    picked = torch.stack(heads) if n else torch.zeros(hkv, 0, dtype=torch.int64)
    na = plan.anchor_pages.shape[1]
    slots = 4 * (n + na) + 8
    first_rows = torch.stack([torch.randperm(slots, generator=g)[: n + na] for _ in range(hkv)]) * p
    first_rows[torch.rand(first_rows.shape, generator=g) < 0.1] = -1
    first_rows[0, 0] = -1  # head 0: its first page rejected (rows clamp up to 0), its last past the pool
    first_rows[0, -1] = (slots - 1) * p
    pool_rows = (slots - 2 * (n + na) - 4) * p + 3  # about half the pages lie past it
    return _to(plan), picked.to(DEV), first_rows.to(DEV), pool_rows


def _to(plan: PagePlan) -> PagePlan:
    return PagePlan(page_size=plan.page_size, lo=plan.lo, hi=plan.hi, first_page=plan.first_page,
                    end_page=plan.end_page, n_pages=plan.n_pages, anchor_pages=plan.anchor_pages.to(DEV),
                    anchor_slot=plan.anchor_slot.to(DEV), anchor_offset=plan.anchor_offset.to(DEV),
                    anchors=plan.anchors.to(DEV))


def _page_step(plan: PagePlan, picked: torch.Tensor, first_rows: torch.Tensor, pool_rows: int) -> PageEntries:
    """What the page step computed for one row with torch ops before the kernel."""
    n_picked = plan.n_pages * plan.page_size
    tokens = entry_tokens(plan, picked[None])
    bias, in_mid = entry_bias(plan, tokens)
    n = plan.n_pages
    anchor = first_rows[:, n:].index_select(-1, plan.anchor_slot) + plan.anchor_offset
    rows = torch.cat([page_tokens(first_rows[:, :n], plan.page_size), anchor], dim=-1)
    return PageEntries(rows=rows[None].clamp(0, pool_rows - 1), bias=bias,
                       tokens=tokens[..., :n_picked].clamp(plan.lo, max(plan.lo, plan.hi - 1)),
                       n_distinct=in_mid.sum())


def _run(plan: PagePlan, picked: torch.Tensor, first_rows: torch.Tensor, pool_rows: int, *, use_triton: bool,
         config: PageEntriesConfig = pe_ops.DEFAULT_PAGE_ENTRIES) -> PageEntries:
    return page_entries(picked, first_rows, plan.anchor_slot, plan.anchor_offset, page_size=plan.page_size,
                        lo=plan.lo, hi=plan.hi, pool_rows=pool_rows, use_triton=use_triton, config=config)


def _assert_equal(x: PageEntries, ref: PageEntries) -> None:
    for name in ("rows", "bias", "tokens", "n_distinct"):
        a, b = getattr(x, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, name
        assert torch.equal(a, b), name


def _assert_exercised(x: PageEntries, pool_rows: int, n: int) -> None:
    """The case reaches the clamps at both ends and masks boundary tokens."""
    assert x.bias.isinf().any() and (x.bias == 0).any()
    assert (x.rows == 0).any() and (x.rows == pool_rows - 1).any()
    assert 0 < int(x.n_distinct) < x.tokens.numel() if n else int(x.n_distinct) == 0


CASES = [(hkv, n, p, anchors) for hkv in (1, 2, 8) for n in (0, 1, 3, 64) for p in (16, 8) for anchors in (0, 1)
         if n or anchors]  # n = 0 needs anchors: the prefix holds only the boundary page otherwise
CASES += [(2, 513, 16, 1), (8, 513, 8, 0), (8, 513, 16, 1)]


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("hkv,n,p,anchors", CASES)
def test_triton_equals_reference_and_page_step(hkv: int, n: int, p: int, anchors: int) -> None:
    sink, tail = (4, 64) if anchors else (0, 0)
    plan, picked, first_rows, pool_rows = _case(hkv, n, p, sink, tail, seed=hkv * 10_000 + n * 10 + p)
    out = _run(plan, picked, first_rows, pool_rows, use_triton=True)
    ref = page_entries_ref(picked, first_rows, plan.anchor_slot, plan.anchor_offset, page_size=p, lo=plan.lo,
                           hi=plan.hi, pool_rows=pool_rows)
    _assert_equal(out, ref)
    _assert_equal(ref, _page_step(plan, picked, first_rows, pool_rows))
    assert out.rows.shape == (1, hkv, plan.n_entries) and out.tokens.shape == (1, hkv, n * p)
    if n and first_rows.shape[1] >= 2:
        _assert_exercised(out, pool_rows, n)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("config", [PageEntriesConfig(block=128, count_block=128, num_warps=1),
                                    PageEntriesConfig(block=256, count_block=2048, num_warps=8)],
                         ids=["small-blocks", "wide-count"])
def test_strided_inputs_and_block_sizes(config: PageEntriesConfig) -> None:
    """``first_rows`` as the device plan hands it (the first columns of a wider table), ``picked`` transposed;
    entries and page ids spread over several programs and count steps."""
    plan, picked, first_rows, pool_rows = _case(3, 70, 16, 4, 64, seed=5)
    wide = torch.full((3, first_rows.shape[1] + 9), 12345, dtype=torch.int64, device=DEV)
    wide[:, : first_rows.shape[1]] = first_rows
    strided_rows = wide[:, : first_rows.shape[1]]
    strided_picked = picked.t().contiguous().t()
    assert not strided_rows.is_contiguous() and not strided_picked.is_contiguous()
    out = _run(plan, strided_picked, strided_rows, pool_rows, use_triton=True, config=config)
    _assert_equal(out, _page_step(plan, picked, first_rows, pool_rows))


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_counts_and_bias_from_tokens(use_triton: bool) -> None:
    """By hand: pages 0 and 3 of size 4 over the mid region [2, 13): tokens 2, 3 and 12 are mid, the rest -inf."""
    picked = torch.tensor([[3, 0]], device=DEV)
    first_rows = torch.tensor([[40, 8, 100]], device=DEV)  # picked pages' rows, then one anchor page's
    slot, offset = torch.tensor([0, 0], device=DEV), torch.tensor([1, 3], device=DEV)
    out = page_entries(picked, first_rows, slot, offset, page_size=4, lo=2, hi=13, pool_rows=102,
                       use_triton=use_triton)
    inf = float("-inf")
    assert out.rows.tolist() == [[[40, 41, 42, 43, 8, 9, 10, 11, 101, 101]]]
    assert out.bias.tolist() == [[[0, inf, inf, inf, inf, inf, 0, 0, 0, 0]]]
    assert out.tokens.tolist() == [[[12, 12, 12, 12, 2, 2, 2, 3]]]
    assert int(out.n_distinct) == 3 and out.n_distinct.dim() == 0


def test_invalid_calls_say_how_to_fix_them() -> None:
    picked = torch.zeros(2, 3, dtype=torch.int64)
    rows = torch.zeros(2, 4, dtype=torch.int64)
    a = torch.zeros(5, dtype=torch.int64)
    kw = {"page_size": 16, "lo": 0, "hi": 100, "pool_rows": 64}
    with pytest.raises(ValueError, match="picked must be a 2-d int64"):
        page_entries(picked.int(), rows, a, a, **kw)
    with pytest.raises(ValueError, match=r"first_rows must be \[Hkv=2, n \+ na\]"):
        page_entries(picked, rows[:1], a, a, **kw)
    with pytest.raises(ValueError, match="anchor_slot .* and anchor_offset .* must match"):
        page_entries(picked, rows, a, a[:4], **kw)
    with pytest.raises(ValueError, match="anchors need their pages' first rows"):
        page_entries(picked, rows[:, :3], a, a, **kw)
    with pytest.raises(ValueError, match="lo <= hi"):
        page_entries(picked, rows, a, a, **{**kw, "lo": 101})
    with pytest.raises(ValueError, match="power of two"):
        PageEntriesConfig(block=100)


needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="the CPU page-entries kernel did not build")


@needs_cpu_kernel
@pytest.mark.parametrize("hkv,n,p,anchors", CASES)
def test_cpu_kernel_equals_reference(hkv: int, n: int, p: int, anchors: int) -> None:
    """The C++ kernel (CPU tensors, no Triton): the reference's entries bit for bit, plus the picked entries'
    rows and mid mask in φ's layout (``rows[..., :n * p]``, ``bias[..., :n * p] == 0``), contiguous."""
    sink, tail = (4, 64) if anchors else (0, 0)
    plan, picked, first_rows, pool_rows = _case(hkv, n, p, sink, tail, seed=hkv * 10_000 + n * 10 + p)
    picked, first_rows, plan = picked.cpu(), first_rows.cpu(), _cpu_plan(plan)
    out = page_entries_cpu(picked, first_rows, plan.anchor_slot, plan.anchor_offset, page_size=p, lo=plan.lo,
                           hi=plan.hi, pool_rows=pool_rows)
    ref = page_entries_ref(picked, first_rows, plan.anchor_slot, plan.anchor_offset, page_size=p, lo=plan.lo,
                           hi=plan.hi, pool_rows=pool_rows)
    _assert_equal(out, ref)
    assert out.mid_rows is not None and out.valid is not None
    assert out.mid_rows.is_contiguous() and out.valid.is_contiguous() and out.valid.dtype == torch.bool
    assert torch.equal(out.mid_rows, ref.rows[..., :n * p]) and torch.equal(out.valid, ref.bias[..., :n * p] == 0)
    via_launcher = page_entries(picked, first_rows, plan.anchor_slot, plan.anchor_offset, page_size=p, lo=plan.lo,
                                hi=plan.hi, pool_rows=pool_rows, use_triton=False)
    assert via_launcher.mid_rows is not None
    _assert_equal(via_launcher, ref)


@needs_cpu_kernel
def test_cpu_kernel_strided_inputs() -> None:
    """``first_rows`` the first columns of a wider table, ``picked`` transposed (as in the Triton test)."""
    plan, picked, first_rows, pool_rows = _case(3, 70, 16, 4, 64, seed=5)
    picked, first_rows, plan = picked.cpu(), first_rows.cpu(), _cpu_plan(plan)
    wide = torch.full((3, first_rows.shape[1] + 9), 12345, dtype=torch.int64)
    wide[:, : first_rows.shape[1]] = first_rows
    strided_rows, strided_picked = wide[:, : first_rows.shape[1]], picked.t().contiguous().t()
    out = page_entries_cpu(strided_picked, strided_rows, plan.anchor_slot, plan.anchor_offset, page_size=16,
                           lo=plan.lo, hi=plan.hi, pool_rows=pool_rows)
    _assert_equal(out, _page_step(plan, picked, first_rows, pool_rows))


def _cpu_plan(plan: PagePlan) -> PagePlan:
    return PagePlan(page_size=plan.page_size, lo=plan.lo, hi=plan.hi, first_page=plan.first_page,
                    end_page=plan.end_page, n_pages=plan.n_pages, anchor_pages=plan.anchor_pages.cpu(),
                    anchor_slot=plan.anchor_slot.cpu(), anchor_offset=plan.anchor_offset.cpu(),
                    anchors=plan.anchors.cpu())
