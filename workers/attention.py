"""The model's attention hook: causal attention over resident tokens, merged with the prefix's.

Registered in transformers' ``AttentionInterface`` as ``"kvstash"``. The model's own cache
holds only resident tokens (query + generated); the stored prefix is attended through the
``kvstash_prefix`` object passed as a forward kwarg, and the two partial softmaxes are merged
exactly through their log-sum-exps.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

KVSTASH_ATTENTION = "kvstash"
PREFIX_KWARG = "kvstash_prefix"
"""Forward kwarg: one generation's ``PrefixAttention``, its own tokens in a transformers cache (tools)."""
STEP_KWARG = "kvstash_step"
"""Forward kwarg: the engine's packed step (``StepAttention``): many generations, own KV outside transformers."""


class PrefixAttention(Protocol):
    """Attention of new tokens' queries over a stored prefix (what a decode method provides)."""

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` -> (out ``[B, Hq, L, D]`` fp32, lse ``[B, Hq, L]`` fp32)."""
        ...


class StepAttention(Protocol):
    """Attention of a packed batch of generations' new tokens (the decode engine's step)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, T, D]``, k, v ``[1, Hkv, T, D]`` of the packed tokens -> out ``[1, Hq, T, D]``."""
        ...


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out, lse) in fp32.

    q ``[B, Hq, L, D]``; k, v ``[B, Hkv, S, D]`` with Hq a multiple of Hkv. With ``q_offset``,
    query i sees keys ``j <= q_offset + i`` (causal); without it every key is visible.
    Returns out ``[B, Hq, L, D]`` and lse ``[B, Hq, L]`` (``-inf`` and zeros where nothing is visible).
    """
    b, hq, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().reshape(b, hkv, g * l, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)).mul_(scale).reshape(b, hkv, g, l, s)
    if q_offset is not None:
        allowed = torch.arange(s, device=q.device)[None, :] <= (q_offset + torch.arange(l, device=q.device))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    out = torch.matmul(p.reshape(b, hkv, g * l, s), v.float()).reshape(b, hq, l, d)
    return out, lse.reshape(b, hq, l)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets (``-inf`` lse means empty)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.nan_to_num(neginf=0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).nan_to_num(0.0).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    l, s = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if l == s:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    allowed = torch.arange(s, device=query.device)[None, :] <= (s - l + torch.arange(l, device=query.device))[:, None]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)


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
        out = _causal_sdpa(query, key, value, scaling)
    else:
        o_loc, lse_loc = dense_attention(query, key, value, scaling, q_offset=key.shape[2] - query.shape[2])
        o_pre, lse_pre = prefix.attend(layer, query, scaling)
        out = merge_attention(o_loc, lse_loc, o_pre, lse_pre)[0].to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register the hook under the name ``"kvstash"`` (idempotent)."""
    AttentionInterface.register(KVSTASH_ATTENTION, kvstash_attention)
