"""Torch reference of Double-P's per-step bookkeeping after the stage-1 masses (the kernel's oracle).

Plain torch ops, the selection's torch form (``DoublePSelector.select`` off the CPU): the ranking (a stable sort,
ties to the lower id), the two top-p prefixes of one cumulative mass, the budgeted stage 2 (one top-p threshold
shared by a group's rows), the exact clusters' token ids read from the cluster-ordered ``perm``, and the
approximated clusters' ids.
"""

from __future__ import annotations

import torch

from .types import DoublePPick

__all__ = ["doublep_select_ref"]


def doublep_select_ref(mass: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor, nonempty: torch.Tensor,
                       perm: torch.Tensor, *, p1: float, p2: float, budget: int | None, groups: int, pad: int,
                       fallback: bool, exact_all: bool = False) -> DoublePPick:
    """See ``ops.doublep_select`` (the same arguments and result)."""
    r, c = mass.shape
    hkv = sizes.shape[0]
    heads = torch.arange(r) % hkv
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices
    rs = sizes[heads].gather(1, order)  # sizes in rank order
    rank = torch.arange(c)
    if exact_all:
        stage1 = n_exact = torch.full((r,), c, dtype=torch.long)
    else:
        m = mass.gather(1, order).double()
        csum = m.cumsum(-1)
        total = m.sum(-1, keepdim=True).clamp_min(1e-300)
        cum = csum / total
        stage1 = ((cum < p1).sum(-1) + 1).clamp_max(c)
        n_exact = torch.minimum(((cum < p2).sum(-1) + 1).clamp_max(c), stage1)
        if budget is not None:
            w = int(n_exact.max())
            before = (csum[:, :w] - m[:, :w]) / total
            entry = torch.where(rank[:w] < n_exact[:, None], before, torch.inf).reshape(groups, -1)
            by_entry = torch.sort(entry, dim=-1, stable=True).indices
            cost = rs[:, :w].reshape(groups, -1).gather(1, by_entry).cumsum(-1)
            take = (cost <= budget) & entry.gather(1, by_entry).isfinite()
            n_exact = torch.zeros_like(take).scatter_(1, by_entry, take).reshape(r, w).sum(-1)
    exact = rank < n_exact[:, None]  # by rank
    counts = (rs * exact).sum(-1)
    width = int(counts.max())
    tokens = torch.full((r, width), pad, dtype=torch.long)
    for i in range(r):
        ids = [perm[starts[heads[i], cl]:][:sizes[heads[i], cl]] for cl in order[i, :int(n_exact[i])].tolist()]
        got = torch.sort(torch.cat(ids).long()).values if ids else torch.zeros(0, dtype=torch.long)
        tokens[i, :got.numel()] = got
    pick = DoublePPick(tokens=tokens, counts=counts, n_ids=int(counts.sum()), n_exact=int(n_exact.sum()))
    if not fallback:
        return pick
    approx = torch.zeros(r, c, dtype=torch.bool).scatter_(1, order, (rank >= n_exact[:, None]) &
                                                          (rank < stage1[:, None])) & nonempty[heads]
    ccounts = approx.sum(-1)
    cids = torch.sort((~approx).to(torch.uint8), dim=-1, stable=True).indices[:, :int(ccounts.max())]
    return DoublePPick(tokens=tokens, counts=counts, n_ids=pick.n_ids, n_exact=pick.n_exact, centroids=cids,
                       n_centroids=ccounts, n_approx=int(ccounts.sum()))
