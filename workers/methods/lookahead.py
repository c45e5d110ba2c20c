"""LookaheadKV at query time: learned lookahead tokens after the query predict which prefix entries the answer needs.

The adapter's ``n_lookahead`` embeddings ride the query's last step after its tokens (their LoRA on,
nothing else's; one forward for both, as the paper appends them to the prompt): they attend the
query's K/V and the whole stored prefix (read once for the query, through the ``PrefixSource``), and
their attention over the prefix, summed over the lookahead tokens, ranks the prefix like SnapKV's
observation window does. The keep set
(``keep_set.py``) then drives the rest of the generation. Their K/V is never kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from store.errors import InvalidInput
from workers.attention import STEP_KWARG, PrefixAttention, ScratchRows, merge_attention
from workers.kernels.dense_attention import dense_attention_ref
from workers.lookahead_adapter import LOOKAHEAD_WEIGHTS, LookaheadAdapter
from workers.methods.base import Method
from workers.methods.keep_set import (
    QueryTimeAttention,
    pooled_scores,
    prefix_attention_and_mass,
    prefix_attention_mass,
)
from workers.methods.snapkv import keep_config
from workers.methods.source import PrefixSource
from workers.own_kv import OwnKV
from workers.requests import DecodeConfig

LayerKV = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""A layer index -> its K, V ``[Hkv, n, D]``."""


class LookaheadPass:
    """The attention of one lookahead forward (a ``StepAttention``): causal over the query's K/V and the lookahead
    tokens, exact over the prefix, recording each query head's attention mass over the prefix."""

    def __init__(self, own_kv: LayerKV, prefix_kv: LayerKV, *, score_from: int = 0, keep_kv: bool = False):
        self.own_kv, self.prefix_kv, self.score_from, self.keep_kv = own_kv, prefix_kv, score_from, keep_kv
        self.mass: dict[int, torch.Tensor] = {}
        """Per layer ``[Hq, N]``: the softmax over the prefix of rows ``score_from`` on, summed over the rows."""
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per layer, the pass's own K, V ``[Hkv, n, D]`` (when ``keep_kv``: training reuses a query's)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, n, D]``, k, v ``[1, Hkv, n, D]`` of the lookahead tokens -> out ``[1, Hq, n, D]``."""
        own_k, own_v = self.own_kv(layer)
        if self.keep_kv:
            self.kv[layer] = (k[0].detach(), v[0].detach())
        keys = torch.cat([own_k.to(k.dtype), k[0]], 1)[None]
        values = torch.cat([own_v.to(v.dtype), v[0]], 1)[None]
        o_own, lse_own = dense_attention_ref(q, keys, values, scale, q_offset=own_k.shape[1])
        pk, pv = self.prefix_kv(layer)
        # One score matrix over the prefix serves the attention and the mass (it was computed twice).
        o_pre, lse_pre, self.mass[layer] = prefix_attention_and_mass(q, pk, pv, scale, self.score_from)
        return merge_attention(o_own, lse_own, o_pre, lse_pre)[0].to(q.dtype)


def lookahead_mass(model: nn.Module, adapter: LookaheadAdapter, own_kv: LayerKV, prefix_kv: LayerKV,
                   position: int) -> dict[int, torch.Tensor]:
    """Run the lookahead tokens at ``position`` onwards; their attention mass over the prefix per layer ``[Hq, N]``."""
    dtype = next(model.parameters()).dtype
    emb = adapter.embeddings[None].to(dtype)
    n = emb.shape[1]
    step = LookaheadPass(own_kv, prefix_kv)
    positions = torch.arange(position, position + n, device=emb.device)[None]
    with adapter.active(torch.ones(1, n, dtype=torch.bool, device=emb.device)):
        model(inputs_embeds=emb, position_ids=positions, use_cache=False, logits_to_keep=1, **{STEP_KWARG: step})
    return step.mass


@dataclass(frozen=True)
class LookaheadModel:
    """The model a generation runs and the lookahead parts shipped with it."""

    model: nn.Module
    adapter: LookaheadAdapter


class LookaheadAttention(QueryTimeAttention):
    """SnapKV's two phases with the lookahead tokens as the observation window: they ride the query's last step
    as scratch rows (``TakesScratchRows``: one forward for both, as the paper appends them to the prompt) and
    their attention over the prefix is the keep set's score. A query that went in without them (nothing
    rode along) is scored by a separate lookahead pass at ``query_done``."""

    def __init__(self, source: PrefixSource, config: DecodeConfig, lookahead: LookaheadModel):
        super().__init__(source, keep_config(config), observe_query=False, scorer=self._scores)
        self.lookahead = lookahead
        self.scratch_mass: dict[int, torch.Tensor] = {}
        """Per layer ``[Hq, N]``: the lookahead rows' attention mass over the prefix, from the query's last step."""

    def scratch_rows(self) -> ScratchRows | None:
        """The lookahead tokens, with their LoRA on, until the keep set is chosen."""
        if self.kept is not None:
            return None
        adapter = self.lookahead.adapter
        dtype = next(self.lookahead.model.parameters()).dtype
        return ScratchRows(adapter.embeddings.detach().to(dtype), adapter)

    def attend_scratch(self, layer: int, q: torch.Tensor, scale: float, n_scratch: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query phase's exact attention for every row, and the last ``n_scratch`` rows' mass over the prefix."""
        out = self.attend(layer, q, scale)
        k, _ = self.layer_full(layer)
        self.scratch_mass[layer] = prefix_attention_mass(q[0, :, q.shape[2] - n_scratch:], k, scale)
        return out

    def _scores(self, attn: QueryTimeAttention, own: OwnKV, position: int) -> dict[int, torch.Tensor]:
        la = self.lookahead
        mass = self.scratch_mass
        if len(mass) != self.source.layout.n_layers:  # nothing rode the query's last step
            mass = lookahead_mass(la.model, la.adapter, own.committed, attn.layer_full, position)
        self.scratch_mass = {}
        attn.counter.info["lookahead_tokens"] = float(la.adapter.config.n_lookahead)
        return {layer: pooled_scores(m, attn.n_kv_heads, attn.cfg.pool_kernel) for layer, m in mass.items()}


class LookaheadKV(Method):
    """A query-time cache of ``budget_tokens`` entries per KV head, chosen by trained lookahead tokens."""

    name = "lookahead"
    fetches_pages = True  # its query step's whole-layer reads go through the worker's tiers

    def __init__(self, lookahead: LookaheadModel | None = None):
        self.lookahead = lookahead

    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """State for one generation (exact over the prefix until the query is in, then the kept set)."""
        if self.lookahead is None:
            raise InvalidInput(f"method 'lookahead' needs the model's trained {LOOKAHEAD_WEIGHTS} beside its weights "
                               "(train one with `python -m lab.train.lookahead`)")
        return LookaheadAttention(source, config, self.lookahead)
