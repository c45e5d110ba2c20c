"""Float32 matmul reference of dense attention with log-sum-exp (the kernels' oracle)."""

from __future__ import annotations

import torch

__all__ = ["dense_attention_ref"]


def dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        q_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out, lse) in fp32.

    q ``[B, Hq, L, D]``; k, v ``[B, Hkv, S, D]`` with Hq a multiple of Hkv. With ``q_offset``,
    query i sees keys ``j <= q_offset + i`` (causal); without it every key is visible.
    Returns out ``[B, Hq, L, D]`` and lse ``[B, Hq, L]`` (``-inf`` and zeros where nothing is visible).
    """
    b, hq, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().reshape(b, hkv, g * l, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)).mul_(scale).reshape(b, hkv, g, l, s)
    if q_offset is not None:
        allowed = torch.arange(s, device=q.device)[None, :] <= (q_offset + torch.arange(l, device=q.device))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    out = torch.matmul(p.reshape(b, hkv, g * l, s), v.float()).reshape(b, hq, l, d)
    return out, lse.reshape(b, hq, l)
