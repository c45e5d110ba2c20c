"""Attention of one batched decode step: many generations' tokens packed into one forward pass.

The engine packs the tokens every running generation feeds this step (a chunk of its query, or its
last sampled token) into one sequence; projections and MLPs run once over all of them, and the
attention hook hands the packed queries here. Each generation's segment attends its own tokens
(causally, from its ``OwnKV``) and its stored prefix (through its decode method's
``PrefixAttention``); the two partial softmaxes merge exactly through their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention import PrefixAttention, merge_attention
from workers.kernels.dense_attention import dense_attention
from workers.kernels.sparse_attention import sparse_decode_attention, sparse_decode_attention_torch
from workers.own_kv import OwnKV


def own_and_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_valid: torch.Tensor, scale: float,
                             o_pre: torch.Tensor, lse_pre: torch.Tensor, out: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """One row q ``[1, Hq, D]`` over the first ``n_valid`` (``[1, Hkv]``) rows of its own k, v ``[Hkv, S, D]`` and
    its prefix's attention (o_pre ``[1, Hq, D]`` float32, lse_pre ``[1, Hq]``) -> out ``[1, Hq, D]`` in q's dtype
    (written into ``out`` when given: on CUDA by the kernel itself, no copy).

    The prefix's partial softmax enters as one pseudo-entry of logit ``lse_pre`` and value ``o_pre``: one softmax
    over the own tokens and that entry is exactly the merge of the two partial softmaxes (``merge_attention``),
    in one kernel launch instead of a launch and about ten elementwise kernels."""
    hq, d = q.shape[1], q.shape[2]
    pl, pv = lse_pre.reshape(1, hq, 1).float(), o_pre.reshape(1, hq, 1, d)
    if q.is_cuda and k.dtype == q.dtype:
        res, _ = sparse_decode_attention(q, k[None], v[None], scale=scale, idx=None, n_valid=n_valid, bias=None,
                                         pseudo_logits=pl, pseudo_values=pv, out=out)
        return res
    op = sparse_decode_attention if q.is_cuda else sparse_decode_attention_torch
    res, _ = op(q.to(k.dtype), k[None], v[None], scale=scale, idx=None, n_valid=n_valid, bias=None,
                pseudo_logits=pl, pseudo_values=pv)
    if out is None:
        return res.to(q.dtype)
    return out.copy_(res)


@dataclass(frozen=True)
class Segment:
    """One generation's tokens in a packed step: positions ``[start, end)`` of the packed sequence."""

    start: int
    end: int
    own: OwnKV
    prefix: PrefixAttention
    key: object
    """Who the segment belongs to (so a failing method can be told apart from the others)."""
    scratch: int = 0
    """Trailing rows that are the prefix's scratch rows (``TakesScratchRows``): attended, never written to own KV."""


class SegmentFailed(Exception):
    """A generation's attention raised during a packed step (the others' segments are not at fault)."""

    def __init__(self, key: object, cause: BaseException):
        super().__init__(str(cause))
        self.key, self.cause = key, cause


class StepBatch:
    """The packed step the attention hook calls (``attend``) once per layer."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments

    def memory_segments(self, layer: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """For a model with a decaying memory (``workers.ratplus.MemorySegments``): the segments' bounds and the
        K, V ``[S, Hkv, D]`` each continues from (its last own token, else its prefix's last token)."""
        states = [s.own.last(layer) for s in self.segments]
        bounds = [0] + [s.end for s in self.segments]
        if any(s.start != b for s, b in zip(self.segments, bounds, strict=False)):
            raise ValueError("packed segments must be contiguous from 0")
        return bounds, torch.stack([k for k, _ in states]), torch.stack([v for _, v in states])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, T, D]``, k, v ``[1, Hkv, T, D]`` of the packed tokens -> out ``[1, Hq, T, D]`` (q's dtype)."""
        out = torch.empty_like(q)
        for s in self.segments:
            try:
                kept = s.end - s.scratch
                own_k, own_v = s.own.write(layer, k[0, :, s.start:kept], v[0, :, s.start:kept])
                qs = q[:, :, s.start:s.end]
                if s.scratch:  # after the written rows, causally, like tokens that are never committed
                    own_k = torch.cat([own_k, k[0, :, kept:s.end]], 1)
                    own_v = torch.cat([own_v, v[0, :, kept:s.end]], 1)
                    o_pre, lse_pre = s.prefix.attend_scratch(layer, qs, scale, s.scratch)  # type: ignore[attr-defined]
                else:
                    o_pre, lse_pre = s.prefix.attend(layer, qs, scale)
                if s.end - s.start == 1 and q.is_cuda:  # the kernel a captured step uses: the same tokens eager
                    # and replayed (on the CPU, where nothing is captured, the fused dense kernel is faster)
                    k_all, v_all = s.own.buffer(layer)
                    n_valid = torch.full((1, k_all.shape[0]), s.own.length + 1, device=q.device)
                    hq, d = q.shape[1], q.shape[3]
                    o = own_and_prefix_attention(qs[0, :, 0][None], k_all, v_all, n_valid, scale,
                                                 o_pre.reshape(1, hq, d), lse_pre.reshape(1, hq))
                    out[:, :, s.start] = o
                    continue
                o_own, lse_own = dense_attention(qs, own_k[None], own_v[None], scale, q_offset=s.own.length)
            except Exception as e:  # noqa: BLE001 - re-raised with the segment's owner attached
                raise SegmentFailed(s.key, e) from e
            out[:, :, s.start:s.end] = merge_attention(o_own, lse_own, o_pre, lse_pre)[0].to(q.dtype)
        return out
