"""Per-token key features for φ completion on the CPU, computed once per generation as tokens are attended.

Each step subtracts the attended mid tokens' ``w_i = exp(log φk(k_i) - m)`` from the stable cache
(``phi.shifted_sums``). Their keys do not change during a generation and ``m`` is fixed per layer, so
``w_i`` is the same every step a token is attended again: consecutive decode steps pick mostly the same
pages (about two thirds of their tokens were attended before at 4k), and on the CPU the feature map of
the rest dominates φ completion (a distilled map is a small MLP per token). ``TokenFeatures`` keeps
``w`` per (KV head, token) and maps only the tokens a step attends for the first time. Where the CPU kernel
builds (``workers/kernels/phi_term``), it reads and fills ``w`` and ``have`` itself; ``weights`` is the torch path.
Reads do not change: the keys mapped are the step's own, already fetched. The bits do not either: a token's
features are those its first step computed, and the map works row by row (tests/test_phi_features.py).
Measured on the shipped model (2-core VM, one thread): φ completion per layer and step 1.2 -> 1.0 ms at 16k
tokens; about even at 4k, where most steps still see a few new pages and a map call costs its op count, not
its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CPU_PHI_FEATURE_BYTES = 256 << 20
"""Bytes of float32 features ``[Hkv, N + 1, F]`` one CPU generation may hold (all layers): 32k tokens of the
shipped model (8 layers, 2 KV heads, F = 16) take 32 MiB; 16k tokens of Llama-3.1-8B-shaped layers (32 x 8 heads,
F = 128) would take 2 GiB. Layers past the cap map their attended keys every step, as before."""


class TokenFeatures:
    """``w = exp(log φk(k) - m)`` ``[Hkv, N, F]`` of one layer's tokens, filled as steps attend them."""

    def __init__(self, m: torch.Tensor, n_tokens: int):
        hkv, f = m.shape
        self.m = m
        self.n_tokens = n_tokens
        # one spare row past the prefix: a step's packed rows that are not new are written there, so a fill
        # needs no boolean indexing (a host sync and a copy per index)
        self.w = torch.empty(hkv, n_tokens + 1, f, dtype=m.dtype, device=m.device)  # rows written before read
        self.have = torch.zeros(hkv, n_tokens + 1, dtype=torch.bool, device=m.device)
        self.heads = torch.arange(hkv, device=m.device).unsqueeze(-1)  # [Hkv, 1]: broadcasts over [T, Hkv, n]

    @property
    def nbytes(self) -> int:
        """Bytes the layer's features may take."""
        return self.w.numel() * self.w.element_size()

    def weights(self, tokens: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor,
                log_phi_k: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``w [T, Hkv, n, F]`` of tokens ``[T, Hkv, n]`` whose keys are ``keys [T, Hkv, n, D]``; 0 where not
        ``valid [T, Hkv, n]`` (as ``exp(-inf)``). ``log_phi_k`` maps keys ``[T, Hkv, n', D]``: the new tokens'
        packed first, or all of them where most are new."""
        tokens = tokens.long().clamp(0, self.n_tokens - 1)  # ids past a row's count may be any value
        new = valid & ~self.have[self.heads, tokens]
        n_new = new.sum(-1, keepdim=True)  # [T, Hkv, 1]
        width = int(n_new.max())
        if 2 * width > tokens.shape[-1]:  # mostly new: mapping every key costs no more than packing them
            w = torch.exp(log_phi_k(keys) - self.m.unsqueeze(-2))
            self._store(torch.where(new, tokens, self.n_tokens), w)
            return w.masked_fill_(~valid.unsqueeze(-1), 0.0)
        if width:
            order = torch.argsort(new.to(torch.int8), dim=-1, descending=True, stable=True)[..., :width]
            packed = keys.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
            # packed rows past a head's new ones (cached or masked tokens) go to the spare row
            ids = torch.where(torch.arange(width, device=new.device) < n_new, tokens.gather(-1, order), self.n_tokens)
            self._store(ids, torch.exp(log_phi_k(packed) - self.m.unsqueeze(-2)))
        return self.w[self.heads, tokens].masked_fill_(~valid.unsqueeze(-1), 0.0)

    def _store(self, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Keep features ``w [T, Hkv, n, F]`` of token ids ``[T, Hkv, n]`` (the spare row takes the rest)."""
        self.w[self.heads, ids] = w
        self.have[self.heads, ids] = True
