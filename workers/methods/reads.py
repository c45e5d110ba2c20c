"""Per-step read counting for sparse methods (what ``GenerationStats`` reports).

A step is one model forward (the first call may carry several query tokens). Per layer the
step reads the union, over its query tokens, of the exact tokens they attend (anchors plus
selected mid tokens) for each KV head, plus the summary bytes its selection scans or attends
(index bytes, e.g. Double-P's centroids); the one-time summary reads are counted separately.
Counts stay on the device until ``report`` (no sync per layer).
"""

from __future__ import annotations

import torch

from workers.methods.base import ReadReport

KV_ONCE = "selector"
"""``add_once`` name of prefix K/V held resident by a selector (the rest of the one-time reads are summaries)."""


class ReadCounter:
    """Accumulates exact-token reads per step, pseudo-entries per step, and one-time bytes."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, token_bytes: int):
        self.n_layers, self.n_kv_heads, self.token_bytes = n_layers, n_kv_heads, token_bytes
        self._tokens: list[list[torch.Tensor]] = []
        self._pseudo: list[list[torch.Tensor]] = []
        self._index: list[list[torch.Tensor]] = []
        self.once_bytes: dict[str, int] = {}
        self.once_token_equiv: dict[str, float] = {}
        self.info: dict[str, float] = {}

    def start_step(self) -> None:
        """Begin a new decode step (called at the step's first layer)."""
        self._tokens.append([])
        self._pseudo.append([])
        self._index.append([])

    def add_layer(self, n_tokens: torch.Tensor | int, n_pseudo: torch.Tensor | int = 0,
                  index_bytes: torch.Tensor | int = 0) -> None:
        """Exact tokens (summed over KV heads), pseudo-entries (per row, summed) and summary bytes scanned
        or attended per step (``Selection.index_bytes``) one layer read."""
        if not self._tokens:
            self.start_step()
        self._tokens[-1].append(torch.as_tensor(n_tokens))
        self._pseudo[-1].append(torch.as_tensor(n_pseudo))
        self._index[-1].append(torch.as_tensor(index_bytes))

    def add_once(self, name: str, n_bytes: int, token_equiv: float = 0.0) -> None:
        """A one-time read (summary artifact, resident selector keys) in bytes and token equivalents
        (per layer and KV head)."""
        self.once_bytes[name] = self.once_bytes.get(name, 0) + n_bytes
        if token_equiv:
            self.once_token_equiv[name] = token_equiv

    def report(self) -> ReadReport:
        """Everything counted so far."""
        per_step = [int(sum(int(t) for t in step)) for step in self._tokens]
        pseudo = [int(sum(int(t) for t in step)) for step in self._pseudo]
        index = sum(int(t) for step in self._index for t in step)
        units = max(1, self.n_layers * self.n_kv_heads)
        steps = max(1, len(per_step))
        extra: dict[str, float] = {
            "exact_tokens_per_step": sum(per_step) / steps,
            "token_equiv_per_step": sum(per_step) / steps / units,
            "pseudo_entries_per_step": sum(pseudo) / steps,
            "index_bytes": float(index),
            "index_bytes_per_step": index / steps,
            "index_token_equiv_per_step": index / steps / units / self.token_bytes,
            **{f"once_bytes_{k}": float(v) for k, v in self.once_bytes.items()},
            **{f"once_token_equiv_{k}": v for k, v in self.once_token_equiv.items()},
            **self.info,
        }
        return ReadReport(tokens_per_step=per_step, step_bytes=sum(per_step) * self.token_bytes + index,
                          once_bytes=sum(self.once_bytes.values()), once_kv_bytes=self.once_bytes.get(KV_ONCE, 0),
                          extra=extra)


def mark_tokens(hits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
    """Count the valid ids of ``tokens [T, Hkv, n]`` (first ``counts [T, Hkv]``) into ``hits [Hkv, N]``."""
    t_rows, hkv, n = tokens.shape
    if n == 0 or t_rows == 0:
        return
    valid = torch.arange(n, device=tokens.device) < counts.unsqueeze(-1)
    ids = torch.where(valid, tokens, 0).permute(1, 0, 2).reshape(hkv, -1)
    hits.scatter_add_(1, ids, valid.permute(1, 0, 2).reshape(hkv, -1).to(hits.dtype))
