"""Plain torch reference of the CPU gather-entries kernel (its oracle): the sparse path's torch form of the same
entries (join valid entries first, gather rows, padding reads row 0 with a zero value and bias ``-inf``)."""

from __future__ import annotations

import torch

__all__ = ["gather_entries_ref"]


def gather_entries_ref(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, n: torch.Tensor,
                       ids_b: torch.Tensor | None = None, n_b: torch.Tensor | None = None,
                       bias_b: torch.Tensor | None = None, table_b: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``ops.gather_entries``."""
    hkv, wa = rows.shape
    n = n.reshape(hkv).clamp(0, wa)
    ids, bias, count = rows.long(), torch.zeros(rows.shape), n
    if ids_b is not None and n_b is not None and bias_b is not None:
        wb = ids_b.shape[1]
        nb = n_b.reshape(hkv).clamp(0, wb)
        e = ids_b.long()
        rows_b = table_b.long().gather(1, e) if table_b is not None else e
        # each head's valid exact rows, then its valid extra rows (a stable sort of validity: valid first)
        ids = torch.cat([ids, rows_b], -1)
        bias = torch.cat([bias, bias_b.float().gather(1, e)], -1)
        valid = torch.cat([torch.arange(wa) < n[:, None], torch.arange(wb) < nb[:, None]], -1)
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
        ids, bias, count = ids.gather(1, order), bias.gather(1, order), n + nb
    valid = torch.arange(ids.shape[1]) < count[:, None]
    safe = torch.where(valid, ids, 0)
    heads = torch.arange(hkv)[:, None]
    kg, vg = k[heads, safe], v[heads, safe].masked_fill(~valid[..., None], 0.0)
    return kg.float(), vg.float(), bias.masked_fill(~valid, -torch.inf)
