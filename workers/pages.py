"""Token ids -> page ids: the page arithmetic of decode (token ``t`` lies in page ``t // page_size``)."""

from __future__ import annotations

import torch

__all__ = ["page_count", "page_mask", "page_of", "page_span"]


def page_count(n_tokens: int, page_size: int) -> int:
    """Pages holding ``n_tokens`` tokens (the last one may be partial)."""
    return -(-n_tokens // page_size)


def page_span(lo: int, hi: int, page_size: int) -> tuple[int, int]:
    """Pages ``[first, end)`` overlapping the token range ``[lo, hi)``."""
    return lo // page_size, -(-hi // page_size)


def page_of(tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page of each token id (same shape; ids must be >= 0 to mean anything)."""
    return torch.div(tokens, page_size, rounding_mode="floor")


def page_mask(tokens: torch.Tensor, counts: torch.Tensor, n_tokens: int,
              page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which pages hold the first ``counts [..., Hkv]`` ids of each row of ``tokens [..., Hkv, n]``.

    Returns ``[Hkv, n_pages]`` bool (rows of all leading indices merged) and the number of those ids
    outside ``[0, n_tokens)`` (a 0-d tensor on the tokens' device; they mark no page). No sync.
    """
    h, n = tokens.shape[-2], tokens.shape[-1]
    n_pages = page_count(n_tokens, page_size)
    if n == 0:  # nothing selected (e.g. a shortlist of 0 at a tiny budget): no page, nothing outside
        return torch.zeros(h, n_pages, dtype=torch.bool, device=tokens.device), torch.zeros((), dtype=torch.long,
                                                                                          device=tokens.device)
    tok = tokens.reshape(-1, h, n)
    valid = torch.arange(n, device=tok.device) < counts.reshape(-1, h, 1).to(tok.device)
    outside = (valid & ((tok < 0) | (tok >= n_tokens))).sum()
    col = torch.where(valid, page_of(tok, page_size).clamp(0, n_pages), n_pages)
    mask = torch.zeros(h, n_pages + 1, dtype=torch.bool, device=tok.device)
    mask.scatter_(1, col.transpose(0, 1).reshape(h, -1).long(), True)
    return mask[:, :n_pages], outside
