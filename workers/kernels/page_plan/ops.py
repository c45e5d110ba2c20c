"""Public launcher of the page plan: one fetch's lookup, hit stamps, windowed-LRU victims and map updates.

A plan of ``pages [Hkv, n]`` (``n <= P``, ``S >= 2P``; -1 = padding) of one layer, per head, in this
order: clock += 1 (= t); hits are stamped t; victims are the ``n`` slots with the smallest
``(stamp, slot)`` among the plan's window of ``W = PlanState.window(n)`` slots, ``(t - 1) * W + i``
modulo ``S`` for ``i < W`` (all ``S`` slots, exact LRU, when ``S`` is small; else at least ``2n``:
none was stamped t, as at most ``n`` of them are hits); the i-th miss in request order takes the i-th
victim, whose page (if any) leaves the map; map, owner and stamp of the victim are set. Outputs, the
first ``n`` entries per head (later entries keep older values): ``src_rows`` and ``dst_slots``
``[Hkv * n]`` (compact) with the host-tier row of each miss (-1 for hits and padding: a skip-negative
gather skips them) and its global slot (0 when skipped); ``rows [Hkv, P][:, :n]``, the first pool row
of each requested page (-1 for padding and rejected ids).

Two implementations with the same result: the Triton kernel (one launch, one program per head: a sort
of the window's slot keys) and the torch reference (~20 ops). Both have fixed shapes for a fixed ``n``
and never sync, so a plan can be captured in a CUDA graph. Kernel tuning (warps) is an argument, never
module state.
"""

from __future__ import annotations

import torch

from ..launch import next_pow2
from .reference import plan_pages_ref
from .state import PlanState

__all__ = ["plan_pages"]

_KEY_MAX = 2**62
_WARPS = (0, 1, 2, 4, 8, 16, 32)


def _fail(msg: str) -> None:
    raise ValueError(f"plan_pages: {msg}")


def _validate(st: PlanState, layer: int, pages: torch.Tensor, num_warps: int) -> None:
    n_layers, heads, _ = st.host_rows.shape
    if not 0 <= layer < n_layers:
        _fail(f"layer {layer} out of range [0, {n_layers})")
    if pages.dim() != 2 or pages.shape[0] != heads or not 1 <= pages.shape[1] <= st.pages_per_call:
        _fail(f"pages must be [{heads}, n] with 1 <= n <= {st.pages_per_call} (the state's pages per call), "
              f"got {tuple(pages.shape)}")
    if pages.dtype != torch.int64 or not pages.is_contiguous():
        _fail(f"pages must be contiguous int64, got {pages.dtype}; pass pages.to(torch.int64).contiguous()")
    if pages.device != st.host_rows.device:
        _fail(f"pages are on {pages.device} but the plan state on {st.host_rows.device}; move them with .to()")
    if num_warps not in _WARPS:
        _fail(f"num_warps must be one of {_WARPS} (0: chosen from the slot count), got {num_warps}")


def plan_pages(st: PlanState, layer: int, pages: torch.Tensor, *, use_triton: bool, num_warps: int = 0) -> None:
    """Plan one fetch of ``pages`` of ``layer``, updating ``st`` and writing its per-layer outputs.

    Parameters
    ----------
    st : PlanState
        Tables of every layer: ``page_to_slot [L, Hkv, n_pages + 1]``, ``slot_to_page`` and ``stamp``
        ``[L, Hkv, S + 1]``, ``clock [L, Hkv]``, ``counters [L, Hkv, 3]``, ``host_rows [L, Hkv, n_pages]``;
        outputs ``src_rows``, ``dst_slots`` ``[L, Hkv * P]`` (the first ``Hkv * n`` written) and
        ``rows [L, Hkv, P]`` (the first ``n`` per head written) (all int64).
    layer : int
        The layer whose tables and outputs are used.
    pages : [Hkv, n] int64, contiguous, on the state's device
        Page ids per KV head (unique per head; -1 padding; ids >= n_pages are counted as rejected).
    use_triton : bool
        The one-launch Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``), else the torch reference.
    num_warps : int
        Warps of the Triton program per head; 0: 8 from a window of 1024 slots, else 4 (on the H200 at 128k,
        where the sort of 1024 keys dominates, 8 warps took 0.37 ms/token against 0.58).
    """
    _validate(st, layer, pages, num_warps)
    if use_triton:
        _launch(st, layer, pages, num_warps)
    else:
        plan_pages_ref(st, layer, pages)


def _launch(st: PlanState, layer: int, pages: torch.Tensor, num_warps: int) -> None:
    from .triton import _plan_kernel

    heads, n = pages.shape
    w = st.window(n)
    warps = num_warps or (8 if w >= 1024 else 4)
    _plan_kernel[(heads,)](pages, n, st.page_to_slot[layer], st.slot_to_page[layer], st.stamp[layer],
                           st.clock[layer], st.counters[layer], st.host_rows[layer], st.src_rows[layer],
                           st.dst_slots[layer], st.rows[layer], st.scratch[layer], st.n_pages, st.slots_per_head,
                           w, st.pages_per_call, st.page_size, BLOCK_P=next_pow2(n), BLOCK_W=next_pow2(w),
                           BLOCK_S=st.scratch.shape[2], KEY_MAX=_KEY_MAX, num_warps=warps)
