"""Token-equivalent read accounting (``topk-phi-completion.txt`` §6.3 and appendix D).

Every quantity is per decode step, per layer and per KV head, in *token equivalents*: one
token equivalent is the bytes of one token's K and V of one KV head, ``B_tok = 2 d_h b``.

- ``n(f) = ceil(f N)``: the per-step budget for a prefill fraction ``f`` of ``N`` tokens (eq. 13).
- ``k_topk(f) = max(0, n(f) - n_sink - n_tail)``: retrieved mid tokens for selection only (eq. 14).
- ``R_phi,once = d_phi / 2 + d_phi / d_h``: the one-time fetch of the stable φ cache
  ``(m, u, T)`` (``d_phi d_h + 2 d_phi`` elements) in token equivalents (eq. 12 / 47).
- ``n_off(L_gen) = ceil(R_phi,once / L_gen)`` and
  ``k_hyb(f, L_gen) = max(0, n(f) - n_sink - n_tail - n_off)`` (eqs. 15, 16, 18): the retrieval
  budget of a φ-completed method when the one-time fetch is amortized over ``L_gen`` steps
  (``L_gen = 1`` is the paper's conservative worst case).

Methods read ``DecodeConfig.budget`` (= f) through ``plan_budget`` so that every method is
compared at matched reads. Exact arithmetic (``Fraction``) keeps the ceilings honest:
``ceil(0.07 * 100)`` is 7, not 8.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from workers.requests import LIMITS


def _fraction(f: float) -> Fraction:
    """The decimal a user typed (0.07), not its binary float neighbour."""
    return Fraction(repr(float(f)))


def n_budget(fraction: float, prefill_len: int) -> int:
    """Per-step token-equivalent budget ``n(f) = ceil(f N)`` (eq. 13)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if prefill_len < 0:
        raise ValueError(f"prefill_len must be >= 0, got {prefill_len}")
    return math.ceil(_fraction(fraction) * prefill_len)


def k_topk(n: int, sink: int, tail: int) -> int:
    """Retrieved mid tokens of selection-only Top-K: ``max(0, n - sink - tail)`` (eq. 14)."""
    return max(0, n - sink - tail)


def phi_once_token_equiv(phi_dim: int, head_dim: int, elem_ratio: Fraction | float = 1) -> Fraction:
    """``R_phi,once = (d_phi d_h + 2 d_phi) / (2 d_h) = d_phi/2 + d_phi/d_h`` token equivalents (eq. 12).

    ``elem_ratio`` is bytes per cache element over bytes per KV element (1 in the paper,
    where both are bf16; 2 for an fp32 cache next to a bf16 KV cache).
    """
    if phi_dim < 0 or head_dim <= 0:
        raise ValueError("phi_dim must be >= 0 and head_dim > 0")
    ratio = elem_ratio if isinstance(elem_ratio, Fraction) else _fraction(elem_ratio)
    return (Fraction(phi_dim, 2) + Fraction(phi_dim, head_dim)) * ratio


def n_off(r_once: Fraction | float, gen_len: int = 1) -> int:
    """Token-equivalent offset ``ceil(R_once / L_gen)`` charged per step (eqs. 15, 18)."""
    if gen_len < 1:
        raise ValueError(f"gen_len must be >= 1, got {gen_len}")
    r = r_once if isinstance(r_once, Fraction) else _fraction(r_once)
    return math.ceil(r / gen_len)


def k_hyb(n: int, sink: int, tail: int, r_once: Fraction | float, gen_len: int = 1) -> int:
    """Retrieved mid tokens of a φ-completed method: ``max(0, n - sink - tail - n_off)`` (eqs. 16, 18)."""
    return max(0, n - sink - tail - n_off(r_once, gen_len))


def reads_per_step(n_exact: int, r_once: Fraction | float = 0, gen_len: int = 1) -> float:
    """Amortized token-equivalent reads per step: ``n_exact + R_once / L_gen`` (eqs. 17, 48)."""
    return float(n_exact + Fraction(r_once) / gen_len)


def token_bytes(head_dim: int, elem_bytes: int) -> int:
    """``B_tok = 2 d_h b``: bytes of one token's K and V for one KV head (eq. 44)."""
    return 2 * head_dim * elem_bytes


def phi_once_bytes(phi_dim: int, head_dim: int, elem_bytes: int) -> int:
    """``(d_phi d_h + 2 d_phi) b``: bytes of one (layer, KV head) stable φ cache (eq. 46)."""
    return (phi_dim * head_dim + 2 * phi_dim) * elem_bytes


@dataclass(frozen=True, kw_only=True)
class BudgetPlan:
    """The matched-read budget of one request (per step, per layer and KV head)."""

    prefill_len: int
    fraction: float
    head_dim: int
    phi_dim: int
    sink: int
    tail: int
    gen_len: int
    n_budget: int
    """``n(f)``: token-equivalent reads allowed per step."""
    k_topk: int
    """Mid tokens a selection-only method retrieves."""
    r_phi_once: float
    """One-time φ cache fetch in token equivalents."""
    n_off: int
    """Per-step offset charged for the φ cache (``ceil(R_once / L_gen)``)."""
    k_hyb: int
    """Mid tokens a φ-completed method retrieves."""
    hybrid_feasible: bool
    """Whether ``n(f)`` covers the anchors and the φ offset (the paper marks other entries "-")."""

    def k_exact(self, completion: bool) -> int:
        """Retrieval budget for a method with or without φ completion."""
        return self.k_hyb if completion else self.k_topk

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def plan_budget(*, prefill_len: int, fraction: float, head_dim: int, phi_dim: int = 0,
                sink: int = LIMITS.sink_default, tail: int = LIMITS.tail_default, gen_len: int = LIMITS.gen_len_default,
                elem_ratio: Fraction | float = 1) -> BudgetPlan:
    """Every budget quantity of appendix D for one prefix and fraction."""
    if sink < 0 or tail < 0:
        raise ValueError("sink and tail must be >= 0")
    n = n_budget(fraction, prefill_len)
    r = phi_once_token_equiv(phi_dim, head_dim, elem_ratio)
    off = n_off(r, gen_len)
    return BudgetPlan(
        prefill_len=prefill_len, fraction=fraction, head_dim=head_dim, phi_dim=phi_dim, sink=sink, tail=tail,
        gen_len=gen_len, n_budget=n, k_topk=k_topk(n, sink, tail), r_phi_once=float(r), n_off=off,
        k_hyb=k_hyb(n, sink, tail, r, gen_len), hybrid_feasible=n >= sink + tail + off,
    )
