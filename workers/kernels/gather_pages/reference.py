"""Torch reference of the page gather (the CPU path, and the Triton kernel's oracle).

Page ``src[src_rows[i]]`` holds raw page bytes: the K block, then the V block, then padding. Its K block
lands in slot ``dst_slots[i]`` of ``k_pool`` (rows ``[s * P, (s + 1) * P)``), its V block in ``v_pool``.
"""

from __future__ import annotations

import torch

__all__ = ["gather_pages_ref"]


def gather_pages_ref(src: torch.Tensor, src_rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     dst_slots: torch.Tensor, *, block_bytes: int, skip_negative: bool = False) -> None:
    """Copy K and V of pages ``src[src_rows]`` into slots ``dst_slots`` (shapes: see ``ops.gather_pages``).

    With ``skip_negative`` entries whose source row is negative copy nothing (filtering them is a
    device -> host sync on CUDA).
    """
    if skip_negative:
        keep = src_rows >= 0
        src_rows, dst_slots = src_rows[keep], dst_slots[keep]
    if src_rows.numel() == 0:
        return
    pages = src.index_select(0, src_rows.to(src.device)).to(k_pool.device)
    per_block = block_bytes // k_pool.element_size()
    n_slots = k_pool.numel() // per_block
    for pool, lo in ((k_pool, 0), (v_pool, block_bytes)):
        blocks = pages[:, lo : lo + block_bytes].contiguous().view(pool.dtype).view(-1, per_block)
        pool.view(-1)[: n_slots * per_block].view(n_slots, per_block).index_copy_(0, dst_slots, blocks)
