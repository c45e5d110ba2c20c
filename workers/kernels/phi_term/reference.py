"""Torch references of the CPU φ-term kernel: the ops φ completion runs without it (``stable_cache.py`` here,
``HeadwiseMLP.forward``), and the kernel's oracle."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from workers.kernels.phi_term.stable_cache import StableCache, evaluate, feature_sums, subtract

__all__ = ["phi_mlp_ref", "phi_term_ref"]


def phi_mlp_ref(weights: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``HeadwiseMLP.forward`` of one layer: rows ``x [..., H, n, D]`` -> ``[..., H, n, F]`` float32."""
    w0, b0, w1, b1, w2, b2, alpha, wo, bo = weights
    x = x.float()
    g0 = torch.matmul(x, w0) + b0[:, None]
    a = F.gelu(torch.matmul(g0, w1) + b1[:, None])
    delta = torch.matmul(a, w2) + b2[:, None]
    g1 = g0 + alpha[:, None, None] * delta
    return torch.matmul(g1, wo) + bo[:, None]


def phi_term_ref(w: torch.Tensor, v: torch.Tensor, m: torch.Tensor, u: torch.Tensor, tc: torch.Tensor,
                 log_phi_q: torch.Tensor, counts: torch.Tensor, n_mid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi.term`` from the entries' features ``w [T, H, n, F]`` (0 where not valid) and values ``v [T, H, n, D]``:
    ``(log_z [T, H, G], mean [T, H, G, D])``, ``log_z`` -inf where ``counts [T, H] >= n_mid``."""
    u_r, t_r = subtract(StableCache(m, u, tc), *feature_sums(w, v.float()))
    log_z, mean = evaluate(log_phi_q, m, u_r, t_r)
    return log_z.masked_fill((counts >= n_mid).unsqueeze(-1), float("-inf")), mean
