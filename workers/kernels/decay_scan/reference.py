"""Torch reference of the decay scan (the CPU path, the autograd path off CUDA, and the kernels' oracle).

Token ``n`` of segment ``s`` (``cu_seqlens[s] <= n < cu_seqlens[s + 1]``) gets
``y_n = g_n ⊙ y_{n-1} + (1 − g_n) ⊙ x_n``, where ``y_{n-1}`` is ``h0[s]`` (zeros without ``h0``) at the
segment's first token. The state is carried in float32; outputs are in ``x``'s dtype.
"""

from __future__ import annotations

import torch

__all__ = ["decay_scan_ref"]


def decay_scan_ref(x: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor,
                   h0: torch.Tensor | None = None) -> torch.Tensor:
    """x, g ``[N, H, D]``, cu_seqlens ``[S + 1]``, h0 ``[S, H, D]`` or None -> y ``[N, H, D]`` (x's dtype).

    Differentiable through torch autograd (a Python loop over tokens: for tests and short CPU runs).
    """
    bounds = cu_seqlens.tolist()
    out: list[torch.Tensor] = []
    for s in range(len(bounds) - 1):
        h = (h0[s].float() if h0 is not None else x.new_zeros(x.shape[1:], dtype=torch.float32))
        for n in range(bounds[s], bounds[s + 1]):
            gn = g[n].float()
            h = gn * h + (1.0 - gn) * x[n].float()
            out.append(h)
    if not out:
        return x.new_empty(x.shape)
    return torch.stack(out).to(x.dtype)
