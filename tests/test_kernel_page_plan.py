"""Page plan kernel == its torch reference: every table and output after a run of random fetches.

The Triton kernel runs in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU)
or on CUDA. (The plan's semantics against a plain Python LRU: ``test_offload_device_plan.py``.)
"""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels.page_plan import WINDOW_MIN, PlanState, plan_pages, plan_pages_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
SCRATCH = ("page_to_slot", "slot_to_page", "stamp")  # their last column is the torch path's scratch


def _state(layers: int, heads: int, n_pages: int, p: int, s: int, page_size: int = 16,
           window_min: int = WINDOW_MIN) -> PlanState:
    host_rows = torch.randperm(layers * heads * n_pages).view(layers, heads, n_pages).to(DEV)
    return PlanState.empty(host_rows=host_rows, slots_per_head=s, pages_per_call=p, page_size=page_size,
                           window_min=window_min)


def _outputs(st: PlanState, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one plan of ``n`` pages per head wrote (later entries keep older values)."""
    m = st.rows.shape[1] * n
    return st.src_rows[layer, :m], st.dst_slots[layer, :m], st.rows[layer, :, :n]


def _request(g: torch.Generator, heads: int, n_pages: int, n: int) -> torch.Tensor:
    """Unique ids per head, some padding (-1) and an occasional id past the prefix (rejected)."""
    rows = []
    for _ in range(heads):
        ids = torch.randperm(n_pages + 2, generator=g)[:n]
        ids[torch.rand(n, generator=g) < 0.2] = -1
        rows.append(ids)
    return torch.stack(rows).to(DEV).contiguous()


@needs_triton
@pytest.mark.parametrize("heads,n_pages,p,s,warps,window_min", [
    (2, 41, 6, 13, 0, WINDOW_MIN), (3, 100, 7, 15, 2, WINDOW_MIN), (1, 9, 4, 8, 4, WINDOW_MIN),
    pytest.param(4, 300, 16, 40, 1, WINDOW_MIN, marks=pytest.mark.slow),  # 10 s in the CPU interpreter
    (2, 300, 6, 50, 0, 4), (3, 200, 5, 37, 2, 8)])  # windows smaller than the head's slots, rotating
def test_triton_equals_reference(heads: int, n_pages: int, p: int, s: int, warps: int, window_min: int) -> None:
    g = torch.Generator().manual_seed(n_pages)
    a, b = _state(2, heads, n_pages, p, s, window_min=window_min), _state(2, heads, n_pages, p, s,
                                                                          window_min=window_min)
    b.host_rows.copy_(a.host_rows)
    for step in range(12):
        n = 1 + step % p
        for layer in range(2):
            pages = _request(g, heads, n_pages, n)
            plan_pages(a, layer, pages, use_triton=False)
            plan_pages(b, layer, pages, use_triton=True, num_warps=warps)
            for name, x, y in zip(("src_rows", "dst_slots", "rows"), _outputs(a, layer, n), _outputs(b, layer, n),
                                  strict=True):
                assert torch.equal(x, y), (step, layer, name)
    for name in ("page_to_slot", "slot_to_page", "stamp", "clock", "counters"):
        x, y = getattr(a, name), getattr(b, name)
        if name in SCRATCH:
            x, y = x[..., :-1], y[..., :-1]
        assert torch.equal(x, y), name
    assert a.counters[..., 0].sum() > 0 and a.counters[..., 2].sum() > 0  # hits and rejected ids were seen


def test_reference_reuses_least_recently_used_slot() -> None:
    st = _state(1, 1, 10, 2, 4)
    for ids in ([0, 1], [2, 3], [0, -1], [4, 5]):  # page 0 touched again: pages 1 and 2 are the victims
        plan_pages_ref(st, 0, torch.tensor([ids], device=DEV))
    resident = {int(p): int(s) for p, s in enumerate(st.page_to_slot[0, 0, :10]) if s >= 0}
    assert sorted(resident) == [0, 3, 4, 5] and resident[4] == 1 and resident[5] == 2
    assert st.counters[0, 0].tolist() == [1, 6, 0]


def test_invalid_calls_say_how_to_fix_them() -> None:
    st = _state(2, 2, 20, 4, 8)
    ok = torch.zeros(2, 3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        plan_pages(st, 2, ok, use_triton=False)
    with pytest.raises(ValueError, match=r"pages must be \[2, n\] with 1 <= n <= 4"):
        plan_pages(st, 0, torch.zeros(2, 5, dtype=torch.int64, device=DEV), use_triton=False)
    with pytest.raises(ValueError, match="contiguous int64"):
        plan_pages(st, 0, ok.int(), use_triton=False)
    with pytest.raises(ValueError, match="num_warps"):
        plan_pages(st, 0, ok, use_triton=False, num_warps=3)
