"""The model's attention hook: causal attention over resident tokens, merged with the prefix's.

Registered in transformers' ``AttentionInterface`` as ``"kvstash"``. The model's own cache
holds only resident tokens (query + generated); the stored prefix is attended through the
``kvstash_prefix`` object passed as a forward kwarg, and the two partial softmaxes are merged
exactly through their log-sum-exps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from transformers import AttentionInterface

from workers.kernels.dense_attention import causal_attention, dense_attention_ref
from workers.kernels.dense_attention import dense_attention as fused_attention

if TYPE_CHECKING:
    from workers.own_kv import OwnKV

KVSTASH_ATTENTION = "kvstash"
PREFIX_KWARG = "kvstash_prefix"
"""Forward kwarg: one generation's ``PrefixAttention``, its own tokens in a transformers cache (tools)."""
STEP_KWARG = "kvstash_step"
"""Forward kwarg: the engine's packed step (``StepAttention``): many generations, own KV outside transformers."""
dense_attention = dense_attention_ref
"""Exact softmax attention returning (out, lse) in fp32 (the fp32 matmul reference; see its docstring)."""


class PrefixAttention(Protocol):
    """Attention of new tokens' queries over a stored prefix (what a decode method provides)."""

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` -> (out ``[B, Hq, L, D]`` fp32, lse ``[B, Hq, L]`` fp32)."""
        ...


@runtime_checkable
class ObservesQuery(Protocol):
    """A ``PrefixAttention`` that changes once the whole query is in (a query-time cache: SnapKV, LookaheadKV)."""

    def query_done(self, own: OwnKV, position: int) -> None:
        """Called once after the step that fed the query's last token, with the generation's own K/V (the
        query's) and the position the next token takes; before the first sampled token is handed out."""
        ...


@runtime_checkable
class VerifiesSummaries(Protocol):
    """A ``PrefixAttention`` whose summaries may still be checked after its query's forward used them."""

    def verify_summaries(self) -> None:
        """Raise (CorruptData) unless the summaries used so far matched their digests; called once the query is in,
        before the first sampled token is handed out (a wait on the disk, not model work: outside the turn)."""
        ...


@runtime_checkable
class GraphablePrefix(Protocol):
    """A ``PrefixAttention`` whose single-token decode step can run inside a CUDA graph of the whole model step.

    ``graph_attend`` holds only device work of fixed shapes (no host sync, no host-side state); what an eager
    ``attend`` also does on the host (counting reads, step numbers) is done by ``account_step`` after each
    run of the captured step, from the read counts the graph left on the device.
    """

    def graph_key(self) -> object | None:
        """What a captured step over this prefix depends on (None: its next step cannot be captured)."""
        ...

    def graph_attend(self, layer: int, q: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One query row q ``[1, Hq, 1, D]`` -> (out ``[1, Hq, 1, D]`` fp32, lse ``[1, Hq, 1]`` fp32, tokens read
        as a 0-dim tensor or None when the method counts no per-step reads)."""
        ...

    def account_step(self, reads: torch.Tensor | None) -> None:
        """Host bookkeeping of one captured step that ran, given each layer's tokens read (``graph_attend``'s,
        ``[n_layers]`` on the device; None when it returned none)."""
        ...


@dataclass(frozen=True)
class ScratchRows:
    """Input rows a method feeds after its query's last token, in the query's own forward, never kept."""

    embeddings: torch.Tensor
    """``[n, hidden]`` input embeddings of the rows (in place of token embeddings)."""
    adapter: RowAdapter
    """What makes the model treat these rows as such (``LookaheadAdapter``: a LoRA on only those rows)."""


class RowAdapter(Protocol):
    """Model changes that apply to chosen rows of a forward only."""

    def active(self, mask: torch.Tensor) -> AbstractContextManager[None]:
        """The block in which the rows where ``mask [1, T]`` is True are adapted."""
        ...


@runtime_checkable
class TakesScratchRows(Protocol):
    """A ``PrefixAttention`` that rides extra rows on its query's last step (LookaheadKV's lookahead tokens).

    The rows continue the query's positions, attend it causally and the prefix like its tokens, and are
    then dropped: their K/V is never committed and no token is sampled from them."""

    def scratch_rows(self) -> ScratchRows | None:
        """The rows to feed after the query's last token now (None: none)."""
        ...

    def attend_scratch(self, layer: int, q: torch.Tensor, scale: float, n_scratch: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend`` for a step whose last ``n_scratch`` rows of q ``[1, Hq, L, D]`` are the scratch rows."""
        ...


class StepAttention(Protocol):
    """Attention of a packed batch of generations' new tokens (the decode engine's step)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, T, D]``, k, v ``[1, Hkv, T, D]`` of the packed tokens -> out ``[1, Hq, T, D]``."""
        ...


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets (``-inf`` lse means empty)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.nan_to_num(neginf=0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).nan_to_num(0.0).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def kvstash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal over the cache, plus the stored prefix if given."""
    layer = module.layer_idx
    assert isinstance(layer, int)
    step: StepAttention | None = kwargs.get(STEP_KWARG)
    if step is not None:
        return step.attend(layer, query, key, value, scaling).transpose(1, 2).contiguous(), None
    prefix: PrefixAttention | None = kwargs.get(PREFIX_KWARG)
    if prefix is None:
        out = causal_attention(query, key, value, scaling)
    else:
        o_loc, lse_loc = fused_attention(query, key, value, scaling, q_offset=key.shape[2] - query.shape[2])
        o_pre, lse_pre = prefix.attend(layer, query, scaling)
        out = merge_attention(o_loc, lse_loc, o_pre, lse_pre)[0].to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register the hook under the name ``"kvstash"`` (idempotent)."""
    AttentionInterface.register(KVSTASH_ATTENTION, kvstash_attention)
