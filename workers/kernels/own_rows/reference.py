"""Torch reference of the own-row write: one ``index_copy_`` per member and tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_own_rows_ref(k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, ks: Sequence[torch.Tensor],
                       vs: Sequence[torch.Tensor]) -> None:
    """Member ``m``'s rows k, v ``[M, Hkv, D]`` -> ``ks[m][:, at[m]]``, ``vs[m][:, at[m]]`` (``[Hkv, S_m, D]``)."""
    for m, (kb, vb) in enumerate(zip(ks, vs, strict=True)):
        pos = at[m:m + 1]
        kb.index_copy_(1, pos, k[m][:, None].to(kb.dtype))
        vb.index_copy_(1, pos, v[m][:, None].to(vb.dtype))
