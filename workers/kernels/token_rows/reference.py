"""Plain torch reference of the CPU token-rows kernel (its oracle): ``HostPageView.token_rows``' arithmetic."""

from __future__ import annotations

import torch

__all__ = ["token_rows_ref"]


def token_rows_ref(tokens: torch.Tensor, counts: torch.Tensor, first_rows: torch.Tensor, page_size: int,
                   n_tokens: int) -> tuple[torch.Tensor, int]:
    """See ``ops.token_rows``."""
    hkv, n_pages = first_rows.shape
    t = tokens.long()
    valid = torch.arange(t.shape[-1]) < counts.long().unsqueeze(-1)
    ok = (t >= 0) & (t < n_tokens)
    if (valid & ~ok).any():
        raise ValueError(f"token ids must lie in [0, {n_tokens})")
    safe = torch.where(ok, t, 0)
    page = safe // page_size
    heads = torch.arange(hkv)[:, None]
    rows = torch.where(ok, first_rows[heads, page] + safe % page_size, -1)
    return rows, int(torch.unique((heads * n_pages + page)[valid]).numel())
