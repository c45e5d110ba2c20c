"""A query-time cache: the prefix entries a scoring pass keeps per KV head, attended for the rest of a generation.

SnapKV and LookaheadKV both run in two phases over a stored prefix. While the query is fed, its
tokens attend the whole prefix exactly (each layer's K/V read once through the ``PrefixSource``: through
the generation's tiers when it has a page fetcher, so a hot prefix comes from the pinned host tier, and
counted once, as the query step's reads: the scoring pass reuses the copy on the device);
once the query is in (``query_done``), importance scores (the query's own attention for SnapKV,
the lookahead tokens' for LookaheadKV) pick ``budget_tokens`` entries per KV head, the full layers
are dropped, and every later step attends only the kept entries (copies on the device: no later fetch).
Scores are per query head, max-pooled over positions and averaged over the GQA group (SnapKV's defaults).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.kernels.dense_attention import dense_attention
from workers.methods.base import ReadReport, mid_range
from workers.methods.reads import KV_ONCE, ReadCounter
from workers.methods.source import PrefixSource
from workers.methods.sparse import offload_counters

if TYPE_CHECKING:
    from workers.own_kv import OwnKV

POOL_KERNEL = 7
"""SnapKV's max-pool window over positions (the paper's and KVCache-Factory's default)."""
DEFAULT_BUDGET_TOKENS = 128
"""Kept entries per KV head when a request names no ``budget_tokens`` (the LookaheadKV paper's main setting)."""


@dataclass(frozen=True, kw_only=True)
class KeepConfig:
    """How many prefix entries a query-time cache keeps per KV head, and which ones always."""

    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    """Entries per KV head kept, anchors included (all of them when the prefix is shorter)."""
    sink: int = 4
    """Leading prefix tokens always kept (part of the budget)."""
    tail: int = 16
    """Trailing prefix tokens always kept (part of the budget)."""
    pool_kernel: int = POOL_KERNEL

    def __post_init__(self) -> None:
        if self.budget_tokens < 1 or min(self.sink, self.tail) < 0 or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError("need budget_tokens >= 1, sink, tail >= 0 and an odd pool_kernel >= 1")


def prefix_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query head's attention over the prefix, softmax over the prefix alone, summed over query rows.

    q ``[Hq, L, D]``; k ``[Hkv, N, D]`` (Hq a multiple of Hkv) -> ``[Hq, N]`` fp32 (differentiable).
    """
    hq, n_rows, d = q.shape
    hkv = k.shape[0]
    logits = torch.matmul(q.float().reshape(hkv, -1, d), k.float().transpose(-1, -2)) * scale
    probs = torch.softmax(logits, dim=-1).reshape(hq, n_rows, k.shape[1])
    return probs.sum(1)


def prefix_attention_and_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mass_from: int = 0
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact attention of q ``[1, Hq, L, D]`` over a non-empty prefix k, v ``[Hkv, N, D]`` and the attention mass of
    rows ``mass_from`` on, from one score matrix: (out ``[1, Hq, L, D]``, lse ``[1, Hq, L]``) as
    ``dense_attention_ref`` gives them (fp32) and mass ``[Hq, N]`` as ``prefix_attention_mass`` (differentiable)."""
    b, hq, n_rows, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    if b != 1 or n == 0:
        raise ValueError(f"need one batch row and a non-empty prefix, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    scores = torch.matmul(q.float().reshape(hkv, -1, d), k.float().transpose(-1, -2)) * scale  # [Hkv, G * L, N]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)
    out = torch.matmul(probs, v.float()).reshape(1, hq, n_rows, d)
    mass = probs.reshape(hq, n_rows, n)[:, mass_from:].sum(1)
    return out, lse.reshape(1, hq, n_rows), mass


def pooled_scores(mass: torch.Tensor, n_kv_heads: int, kernel: int = POOL_KERNEL) -> torch.Tensor:
    """Per-query-head scores ``[Hq, N]`` -> per-KV-head ``[Hkv, N]``: max-pool over positions, mean over the group."""
    hq, n = mass.shape
    pooled = F.max_pool1d(mass[None], kernel_size=kernel, stride=1, padding=kernel // 2)[0] if kernel > 1 else mass
    return pooled.reshape(n_kv_heads, hq // n_kv_heads, n).mean(1)


def keep_ids(scores: torch.Tensor, cfg: KeepConfig) -> torch.Tensor:
    """The ``budget_tokens`` ids per KV head with the highest scores, anchors first: ``[Hkv, b]`` ascending."""
    hkv, n = scores.shape
    b = min(cfg.budget_tokens, n)
    lo, hi = mid_range(n, cfg.sink, cfg.tail)
    ranked = scores.float().clone()
    ranked[:, :lo] = float("inf")  # anchors win every tie-free slot (the budget counts them)
    ranked[:, hi:] = float("inf")
    if (n - hi) + lo > b:  # anchors alone overflow the budget: the tail goes first, then the sink
        ranked[:, :lo] = torch.finfo(torch.float32).max
    ids = torch.topk(ranked, b, dim=1).indices
    return ids.sort(dim=1).values


class QueryTimeAttention:
    """Exact attention over the whole prefix while the query is fed, then over the kept entries only.

    ``scorer`` runs at ``query_done`` and returns per-layer scores ``{layer: [Hkv, N]}`` (None: the
    query's own accumulated attention, i.e. SnapKV).
    """

    def __init__(self, source: PrefixSource, cfg: KeepConfig, *, observe_query: bool,
                 scorer: Callable[[QueryTimeAttention, OwnKV, int], dict[int, torch.Tensor]] | None = None):
        self.source, self.cfg, self.observe_query, self.scorer = source, cfg, observe_query, scorer
        lay = source.layout
        self.n_kv_heads = lay.n_kv_heads
        self.counter = ReadCounter(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, token_bytes=lay.token_kv_bytes())
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Each layer's whole K/V ``[Hkv, N, D]`` while the query is fed (read once, dropped at ``query_done``)."""
        self.mass: dict[int, torch.Tensor] = {}
        """The query's accumulated attention mass per layer ``[Hq, N]`` (SnapKV)."""
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kept_ids: dict[int, torch.Tensor] = {}
        self.uncounted: set[int] = set()
        """Layers read through the source that no query step has attended yet (their read is not counted yet)."""

    def layer_full(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's whole K/V, read through the source on first use (counted by the step that attends it, or
        once as prefix K/V at ``query_done`` when no step did)."""
        if layer not in self.full:  # filed under the step being fed (the query's, or its last at scoring)
            self.full[layer] = self.source.whole_layer(layer, step=max(0, self.counter.steps - 1))
            self.uncounted.add(layer)
        return self.full[layer]

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` over the whole prefix (query phase) or the kept entries (after ``query_done``)."""
        if layer == 0:
            self.counter.start_step()
        if self.kept is not None:
            k, v = self.kept[layer]
            self.counter.add_layer(k.shape[0] * k.shape[1])
            return dense_attention(q, k[None], v[None], scale)
        k, v = self.layer_full(layer)
        self.counter.add_layer(k.shape[0] * k.shape[1])  # the query step's read of the layer: counted here only
        self.uncounted.discard(layer)
        if self.observe_query:
            mass = prefix_attention_mass(q[0], k, scale)
            self.mass[layer] = mass if layer not in self.mass else self.mass[layer] + mass
        return dense_attention(q, k[None], v[None], scale)

    def query_done(self, own: OwnKV, position: int) -> None:
        """The query is in: score, keep ``budget_tokens`` entries per KV head, drop the full layers."""
        if self.kept is not None:
            return
        if self.scorer is not None:
            scores = self.scorer(self, own, position)
        else:
            scores = {layer: pooled_scores(m, self.n_kv_heads, self.cfg.pool_kernel) for layer, m in self.mass.items()}
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.source.layout.n_layers):
            k, v = self.layer_full(layer)
            ids = keep_ids(scores[layer], self.cfg)
            at = ids.unsqueeze(-1).expand(-1, -1, k.shape[-1])
            kept[layer] = (k.gather(1, at).contiguous(), v.gather(1, at).contiguous())
            self.kept_ids[layer] = ids
        for layer in sorted(self.uncounted):  # read for scoring only, never attended by a step
            k, _ = self.full[layer]
            self.counter.add_once(KV_ONCE, 2 * k.numel() * k.element_size())
        self.kept, self.full, self.mass, self.uncounted = kept, {}, {}, set()
        self.counter.info["kept_tokens_per_head"] = float(next(iter(kept.values()))[0].shape[1])

    def read_report(self) -> ReadReport:
        """The whole prefix per step while the query was fed, the kept entries per step after (tokens, as
        without a fetcher; the ``offload_*`` counters say which tiers the whole-layer reads came from)."""
        report = self.counter.report()
        if (fetcher := self.source.fetcher) is not None:
            report.extra.update(offload_counters(fetcher, None, len(report.tokens_per_step)))
        return report
