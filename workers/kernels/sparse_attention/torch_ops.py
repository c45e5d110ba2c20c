"""Sparse decode attention in a few float32 torch ops: the path for devices without the Triton kernel (CPU).

Same contract as ``ops.sparse_decode_attention`` (and its float64 oracle ``reference``): the
attended rows are gathered once (only the ``N`` entries, never a widened copy of the buffer),
then one batched matmul per side with the GQA group folded into the query rows, and the
pseudo-entries joined under the same log-sum-exp.
"""

from __future__ import annotations

import torch

__all__ = ["sparse_decode_attention_torch"]


def _gather_rows(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx [B, Hkv, N]`` of ``buf [B, Hkv, S, D]`` -> ``[B, Hkv, N, D]`` (buf may be broadcast over B)."""
    b, h, n = idx.shape
    s, d = buf.shape[2], buf.shape[3]
    one = buf[0]
    if b == 1 or buf.stride(0) == 0:
        if one.stride(0) == 0 and one[0].is_contiguous():  # rows shared by every head (a page-cache pool)
            return one[0].index_select(0, idx.reshape(-1)).view(b, h, n, d)
        if one.is_contiguous():  # one shared buffer: a single row gather
            rows = idx + torch.arange(0, h * s, s, device=idx.device).view(1, h, 1)
            return one.view(h * s, d).index_select(0, rows.view(-1)).view(b, h, n, d)
    bi = torch.arange(b, device=idx.device).view(b, 1, 1)
    hi = torch.arange(h, device=idx.device).view(1, h, 1)
    return buf[bi, hi, idx]


def sparse_decode_attention_torch(
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
    """``sparse_decode_attention`` computed in float32 with torch ops (any device).

    Shapes as there: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]`` (a buffer broadcast over B is not
    copied); idx ``[B, Hkv, N]``; n_valid ``[B, Hkv]``; bias ``[B, Hkv, N]``; pseudo_logits
    ``[B, Hq, M]``; pseudo_values ``[B, Hq, M, D]``. Returns out ``[B, Hq, D]`` (q's dtype; 0 where
    nothing is attended) and lse ``[B, Hq]`` float32 (``-inf`` there).
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n = idx.shape[-1] if idx is not None else k.shape[2]
    valid = None
    tail = 0  # entries before it are valid in every row: the masking below only touches the rest
    if n_valid is not None:
        counts = n_valid.clamp(0, n)
        valid = torch.arange(n, device=q.device) < counts.unsqueeze(-1)  # [B, Hkv, N]
        if q.device.type == "cpu" and counts.numel():
            tail = int(counts.min())
    if idx is None:
        kg, vg = k, v
    else:
        safe = idx.long() if valid is None else torch.where(valid, idx.long(), 0)  # padding reads row 0
        kg, vg = _gather_rows(k, safe), _gather_rows(v, safe)
    if valid is not None:  # padding has weight 0, but 0 * a non-finite row would still poison the sum
        if idx is not None:  # in place on the gathered copy
            vg[..., tail:, :].masked_fill_(~valid[..., tail:].unsqueeze(-1), 0.0)
        else:
            vg = vg.masked_fill(~valid.unsqueeze(-1), 0.0)
    qg = q.float().reshape(b, hkv, g, d)
    logits = torch.matmul(qg, kg.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, N]
    if bias is not None:
        logits.add_(bias.float().unsqueeze(2))
    if valid is not None:
        logits[..., tail:].masked_fill_(~valid[..., tail:].unsqueeze(2), float("-inf"))
    pl = pseudo_logits.float().reshape(b, hkv, g, -1) if pseudo_logits is not None else None
    lse = torch.logsumexp(logits if pl is None else torch.cat([logits, pl], dim=-1), dim=-1)  # [B, Hkv, G]
    safe_lse = lse.nan_to_num(neginf=0.0).unsqueeze(-1)  # nothing attended: every weight is exp(-inf) = 0
    out = torch.matmul(logits.sub_(safe_lse).exp_(), vg.float())
    if pl is not None and pseudo_values is not None:
        w = (pl - safe_lse).exp_()  # [B, Hkv, G, M]
        if w.shape[-1] == 1:  # one pseudo-entry (φ): the matmul's single product, the same bits in one op
            out.add_(w * pseudo_values.float().reshape(b, hkv, g, d))
        else:
            pv = pseudo_values.float().reshape(b, hkv, g, -1, d)
            out.add_(torch.matmul(w.unsqueeze(-2), pv).squeeze(-2))
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)
