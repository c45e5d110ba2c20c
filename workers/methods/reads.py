"""Per-step read counting for sparse methods (what ``GenerationStats`` reports).

The one definition of a generation's reads, used by ``--stats``, ``kvstash eval`` and the docs:
``bytes_fetched`` is every byte of the stored prefix a generation read, in every tier, and
``read fraction = bytes_fetched / bytes_full``, where ``bytes_full`` is what exact attention reads
over the same steps (every prefix token's K and V, per layer and KV head, per step). It sums

- per step: the exact tokens attended (sink + tail anchors and selected mid tokens, their K and V)
  and the exact keys selection read (``topk-token``'s shortlist beyond the tokens attended, K
  only) and the summary bytes selection scans or attends per step (Double-P's centroids, its
  exact clusters' token ids); with a page fetcher, instead, the whole pages the step requested from the tiers (GPU
  page cache hits included), since those are what moved (query-time caches, SnapKV and LookaheadKV, count
  their query step's whole-layer read in tokens: every token of the prefix, the same bytes as its pages but
  for a partial last page);
- once per generation: every summary and index read at open (Quest's page bounds, the key index,
  Double-P's clusters, the φ cache), also when the summary cache or another generation over the prefix served
  it (as page-cache hits count: a generation's reads do not depend on what else runs), and prefix K/V a
  selector holds (``topk-exact``'s keys).

One-time bytes are thus amortized over the generation's actual steps (a step is one model
forward; the first may carry several query tokens, and counts the union of what its rows read).
``DecodeConfig.gen_len`` only sets the budget plan (how a φ cache is charged when sizing k).
Counts stay on the device until ``report`` (no sync per layer).
"""

from __future__ import annotations

import torch

from workers.methods.base import ReadReport

Count = torch.Tensor | int
"""A count as a python int or a device tensor (summed over its elements when read)."""

KV_ONCE = "selector"
"""``add_once`` name of prefix K/V held resident by a selector (the rest of the one-time reads are summaries)."""


class ReadCounter:
    """Accumulates exact-token and key-only reads per step, pseudo-entries per step, and one-time bytes."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, token_bytes: int):
        self.n_layers, self.n_kv_heads, self.token_bytes = n_layers, n_kv_heads, token_bytes
        # Each entry: a python int or a device tensor (one layer's count, or a captured step's counts of every
        # layer); summed at ``report``, so a step costs no sync and no host tensor per layer.
        self._tokens: list[list[Count]] = []
        self._pseudo: list[list[Count]] = []
        self._keys: list[list[Count]] = []
        self._index: list[list[Count]] = []
        self.once_bytes: dict[str, int] = {}
        self.once_token_equiv: dict[str, float] = {}
        self.info: dict[str, float] = {}

    @property
    def steps(self) -> int:
        """Steps begun so far."""
        return len(self._tokens)

    @property
    def key_bytes(self) -> int:
        """Bytes of one token's key of one KV head (half of ``token_bytes``)."""
        return self.token_bytes // 2

    def start_step(self) -> None:
        """Begin a new decode step (called at the step's first layer)."""
        self._tokens.append([])
        self._pseudo.append([])
        self._keys.append([])
        self._index.append([])

    def add_layer(self, n_tokens: Count, n_pseudo: Count = 0, n_keys: Count = 0, index_bytes: Count = 0) -> None:
        """Exact tokens (K and V, summed over KV heads), pseudo-entries (per row, summed), key-only reads of
        selection (summed over KV heads) and summary bytes scanned or attended per step
        (``Selection.index_bytes``) of one layer; a tensor of several elements counts their sum (a captured
        step's layers at once)."""
        if not self._tokens:
            self.start_step()
        self._tokens[-1].append(n_tokens)
        self._pseudo[-1].append(n_pseudo)
        self._keys[-1].append(n_keys)
        self._index[-1].append(index_bytes)

    def add_once(self, name: str, n_bytes: int, token_equiv: float = 0.0) -> None:
        """A one-time read (summary artifact, resident selector keys) in bytes and token equivalents
        (per layer and KV head)."""
        self.once_bytes[name] = self.once_bytes.get(name, 0) + n_bytes
        if token_equiv:
            self.once_token_equiv[name] = token_equiv

    def report(self) -> ReadReport:
        """Everything counted so far."""
        per_step = [sum(_total(t) for t in step) for step in self._tokens]
        pseudo = [sum(_total(t) for t in step) for step in self._pseudo]
        keys = [sum(_total(t) for t in step) for step in self._keys]
        index = sum(_total(t) for step in self._index for t in step)
        units = max(1, self.n_layers * self.n_kv_heads)
        steps = max(1, len(per_step))
        extra: dict[str, float] = {
            "exact_tokens_per_step": sum(per_step) / steps,
            "token_equiv_per_step": sum(per_step) / steps / units,
            "pseudo_entries_per_step": sum(pseudo) / steps,
            "selection_keys_per_step": sum(keys) / steps,
            "index_bytes": float(index),
            "index_bytes_per_step": index / steps,
            "index_token_equiv_per_step": index / steps / units / self.token_bytes,
            **{f"once_bytes_{k}": float(v) for k, v in self.once_bytes.items()},
            **{f"once_token_equiv_{k}": v for k, v in self.once_token_equiv.items()},
            **self.info,
        }
        step_bytes = sum(per_step) * self.token_bytes + sum(keys) * self.key_bytes + index
        return ReadReport(tokens_per_step=per_step, step_bytes=step_bytes,
                          once_bytes=sum(self.once_bytes.values()), once_kv_bytes=self.once_bytes.get(KV_ONCE, 0),
                          extra=extra)


def _total(count: Count) -> int:
    """A count's value (a tensor's elements summed; syncs once for a device tensor)."""
    return int(count.sum()) if isinstance(count, torch.Tensor) else int(count)


def mark_tokens(hits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
    """Count the valid ids of ``tokens [T, Hkv, n]`` (first ``counts [T, Hkv]``) into ``hits [Hkv, N]``."""
    t_rows, hkv, n = tokens.shape
    if n == 0 or t_rows == 0:
        return
    valid = torch.arange(n, device=tokens.device) < counts.unsqueeze(-1)
    ids = torch.where(valid, tokens, 0).permute(1, 0, 2).reshape(hkv, -1)
    hits.scatter_add_(1, ids, valid.permute(1, 0, 2).reshape(hkv, -1).to(hits.dtype))
