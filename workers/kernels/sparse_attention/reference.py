"""Float64 torch reference for sparse decode attention (the kernel's oracle).

Every attended entry is a (logit, value) pair under one softmax:

- buffer entries ``j < n_valid[b, h]`` of the gathered set: logit
  ``scale * q . k[idx[j]] + bias[j]``, value ``v[idx[j]]``;
- pseudo-entries: logit ``pseudo_logits[m]`` (already scaled), value
  ``pseudo_values[m]``.

Exact tokens (bias 0), Double-P centroids (bias ``log s``) and the phi completion
term (logit ``log Z_R``, value ``N_R / Z_R``) are therefore merged in the
unnormalized domain and normalized once. Query head ``hq`` reads KV head
``hq // G`` (``G = Hq // Hkv``), the ``repeat_interleave`` convention of GQA.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_decode_attention_ref"]


def _gather_entries(
    k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor | None, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys/values ``[B, Hkv, N, D]``; padding rows read row 0 (masked later)."""
    if idx is None:
        return k, v
    safe = torch.where(valid, idx.long(), torch.zeros_like(idx, dtype=torch.long))
    gidx = safe.unsqueeze(-1).expand(*safe.shape, k.shape[-1])
    return torch.gather(k, 2, gidx), torch.gather(v, 2, gidx)


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    idx: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    pseudo_logits: torch.Tensor | None = None,
    pseudo_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``ops.sparse_decode_attention``, computed in float64.

    Parameters
    ----------
    q : [B, Hq, D]
    k, v : [B, Hkv, S, D]
    scale : float
    idx : [B, Hkv, N] integer, optional (default ``arange(S)``)
    n_valid : [B, Hkv] integer, optional (default N)
    bias : [B, Hkv, N] float, optional
    pseudo_logits : [B, Hq, M] float, optional
    pseudo_values : [B, Hq, M, D] float, optional

    Returns
    -------
    out : [B, Hq, D] float64, zero where nothing is attended
    lse : [B, Hq] float64, natural log-sum-exp of all logits, -inf when empty
    """
    q64, k64, v64 = q.double(), k.double(), v.double()
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    N = idx.shape[-1] if idx is not None else k.shape[2]
    pos = torch.arange(N, device=q.device)
    limit = n_valid.long().clamp(0, N) if n_valid is not None else torch.full((B, Hkv), N, device=q.device)
    valid = pos.view(1, 1, N) < limit.unsqueeze(-1)  # [B, Hkv, N]
    kg, vg = _gather_entries(k64, v64, idx, valid)
    kg, vg = kg.repeat_interleave(G, dim=1), vg.repeat_interleave(G, dim=1)  # [B, Hq, N, D]
    logits = torch.einsum("bhd,bhnd->bhn", q64, kg) * scale
    if bias is not None:
        logits = logits + bias.double().repeat_interleave(G, dim=1)
    logits = logits.masked_fill(~valid.repeat_interleave(G, dim=1), float("-inf"))
    values = vg.masked_fill(~valid.repeat_interleave(G, dim=1).unsqueeze(-1), 0.0)  # padding is never read
    if pseudo_logits is not None and pseudo_values is not None:
        logits = torch.cat([logits, pseudo_logits.double()], dim=-1)
        values = torch.cat([values, pseudo_values.double()], dim=2)
    if logits.shape[-1] == 0:
        return q64.new_zeros(B, Hq, D), q64.new_full((B, Hq), float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(logits - m)
    z = w.sum(dim=-1)
    num = torch.einsum("bhn,bhnd->bhd", w, values)
    out = torch.where(z.unsqueeze(-1) > 0, num / z.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(num))
    lse = m.squeeze(-1) + torch.log(z)
    return out, lse
