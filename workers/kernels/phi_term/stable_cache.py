"""The stable (m, u, T) cache of φ completion and its per-step algebra (``topk-phi-completion.txt``, appendix C):
plain torch on any device. ``workers/methods/phi.py`` builds and uses it; the CPU φ-term kernel's torch
reference (``reference.py`` here) is these ops, so they live beside the kernel (kernels import nothing else of
the project)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

U_FLOOR = 1e-30
"""``u_R`` of a feature with no remaining mass (its ``T_R`` is zeroed): ``log u_R`` ~ -69."""


@dataclass(frozen=True)
class StableCache:
    """``(m, u, T)``: shapes ``[..., F]``, ``[..., F]``, ``[..., F, D]``."""

    m: torch.Tensor
    u: torch.Tensor
    t: torch.Tensor

    def natural(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u_M, S_M) = (exp(m) u, exp(m) T)`` (eq. 37); overflows for large logits, tests only."""
        scale = torch.exp(self.m)
        return scale * self.u, scale[..., None] * self.t


def shifted_sums(m: torch.Tensor, log_phi_k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_i exp(log φk_i - m), Σ_i exp(log φk_i - m) v_i)`` over axis -2 (eqs. 35-36, 38-39).

    ``m [..., F]`` broadcasts against ``log_phi_k [..., n, F]`` (``-inf`` rows contribute 0) and
    ``v [..., n, D]``; returns ``[..., F]`` and ``[..., F, D]``.
    """
    return feature_sums(torch.exp(log_phi_k - m.unsqueeze(-2)), v)


def feature_sums(w: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_i w_i, Σ_i w_i v_i)`` over axis -2 of shifted features ``w [..., n, F]`` and ``v [..., n, D]``."""
    return w.sum(-2), torch.matmul(w.transpose(-1, -2), v.to(w.dtype))


def stable_cache(log_phi_k: torch.Tensor, v: torch.Tensor) -> StableCache:
    """The cache of one set in one pass: ``log_phi_k [..., n, F]``, ``v [..., n, D]``."""
    m = log_phi_k.amax(-2) if log_phi_k.shape[-2] else log_phi_k.new_zeros(log_phi_k.shape[:-2] + log_phi_k.shape[-1:])
    m = torch.where(torch.isfinite(m), m, 0.0)  # a feature no key has (log φ = -inf everywhere)
    u, t = shifted_sums(m, log_phi_k, v)
    return StableCache(m, u, t)


def subtract(cache: StableCache, u_k: torch.Tensor, t_k: torch.Tensor,
             rel_tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Remainder ``(u_R, T_R) = (u - u_K, T - T_K)`` (eq. 40), clamped.

    A feature whose remainder is at most ``rel_tol * u`` (rounding noise of the subtraction) has
    no remaining mass: ``u_R = U_FLOOR`` and ``T_R = 0``.
    """
    tol = rel_tol if rel_tol is not None else 64 * torch.finfo(cache.u.dtype).eps
    u_r = cache.u - u_k
    empty = u_r <= tol * cache.u
    # in place on the fresh differences: the values torch.where gave, without two more buffers per step
    return u_r.masked_fill_(empty, U_FLOOR), (cache.t - t_k).masked_fill_(empty.unsqueeze(-1), 0.0)


def evaluate(log_phi_q: torch.Tensor, m: torch.Tensor, u_r: torch.Tensor,
             t_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log Ẑ_R [..., G], N̂_R / Ẑ_R [..., G, D])`` (eqs. 41-43).

    ``log_phi_q [..., G, F]`` against ``m``, ``u_r [..., F]`` and ``t_r [..., F, D]`` (broadcast over G).
    """
    a = log_phi_q + (m + torch.log(u_r)).unsqueeze(-2)
    w = torch.softmax(a, dim=-1)
    return torch.logsumexp(a, dim=-1), torch.matmul(w, t_r / u_r.unsqueeze(-1))
