"""KVzip's context-reconstruction score: how much each stored KV pair is attended while the model repeats
the context.

The prefix is stored; the model is fed its reconstruction prompt followed by the context's own tokens
(teacher forcing), in chunks: each chunk is the prompt plus the next ``chunk_tokens`` context tokens,
attending the whole stored context and itself (causally), so memory stays bounded on long contexts.
A KV pair's score is the largest softmax probability any reconstruction query gives it, over the query
heads of its KV head (``S_{l,h}(i) = max_{g, j} A[g, j, i]``). Heads outside ``heads`` are run (the next
layers need their output) but not scored: HybridKV's saving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.attention import STEP_KWARG, merge_attention
from workers.kernels.dense_attention import dense_attention
from workers.model import LoadedModel


@dataclass(frozen=True, kw_only=True)
class ReconstructConfig:
    """Bounds of one reconstruction scoring pass."""

    chunk_tokens: int = 1024
    """Context tokens repeated per forward pass (the prompt is prepended to each chunk)."""
    max_score_elems: int = 1 << 24
    """Attention probabilities materialized at once (query rows are scored in blocks under this)."""

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.max_score_elems < 1:
            raise ValueError("chunk_tokens and max_score_elems must be positive")


def reconstruction_inputs(lm: LoadedModel, context_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, repeated context ids): the model's repeat question in its query format, then the
    context re-tokenized as the answer the model was trained to give."""
    tok = lm.tokenizer
    prompt = list(tok(lm.prompt.format_query(lm.prompt.repeat_question), add_special_tokens=False).input_ids)
    text = str(tok.decode(list(context_ids), skip_special_tokens=True))
    repeat = list(tok(lm.prompt.answer_prefix + text, add_special_tokens=False).input_ids)
    return prompt, repeat


class _ScoringStep:
    """The attention hook of one reconstruction chunk: exact attention over context + chunk, and the max
    probability each context key receives on the scored heads."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], heads: torch.Tensor, scores: torch.Tensor,
                 max_elems: int):
        self.kv, self.heads, self.scores, self.max_elems = kv, heads, scores, max_elems

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, T, D]``, k, v ``[1, Hkv, T, D]`` of the chunk -> out ``[1, Hq, T, D]``."""
        ck, cv = self.kv[layer]
        o_ctx, lse_ctx = dense_attention(q, ck[None], cv[None], scale)
        o_own, lse_own = dense_attention(q, k, v, scale, q_offset=0)
        out, lse = merge_attention(o_ctx, lse_ctx, o_own, lse_own)
        hkv, n = ck.shape[0], ck.shape[1]
        g, t = q.shape[1] // hkv, q.shape[2]
        rows = max(1, self.max_elems // max(1, g * n))
        for h in torch.nonzero(self.heads[layer]).flatten().tolist():
            qh = q[0, h * g:(h + 1) * g].float()  # [G, T, D]
            kh = ck[h].float()
            for r0 in range(0, t, rows):
                r1 = min(t, r0 + rows)
                logits = torch.matmul(qh[:, r0:r1], kh.T).mul_(scale)  # [G, rows, N]
                p = torch.exp(logits - lse[0, h * g:(h + 1) * g, r0:r1, None])
                best = p.amax(dim=(0, 1))
                torch.maximum(self.scores[layer, h], best, out=self.scores[layer, h])
        return out.to(q.dtype)


@torch.inference_mode()
def reconstruction_scores(lm: LoadedModel, context_ids: Sequence[int],
                          kv: Sequence[tuple[torch.Tensor, torch.Tensor]], *, heads: torch.Tensor | None = None,
                          config: ReconstructConfig | None = None) -> torch.Tensor:
    """Scores ``[layers, kv_heads, n_tokens]`` float32 of the stored context's KV pairs ``kv`` (per layer K, V
    ``[kv_heads, n_tokens, head_dim]`` on the model's device); unscored heads (``heads`` False) stay 0."""
    cfg = config or ReconstructConfig()
    lay = lm.layout
    n = len(context_ids)
    dev = lm.device
    mask = torch.ones(lay.n_layers, lay.n_kv_heads, dtype=torch.bool) if heads is None else heads.bool().cpu()
    scores = torch.zeros(lay.n_layers, lay.n_kv_heads, n, dtype=torch.float32, device=dev)
    prompt, repeat = reconstruction_inputs(lm, context_ids)
    step = _ScoringStep(kv, mask, scores, cfg.max_score_elems)
    base = lm.model.get_decoder()
    for start in range(0, len(repeat), cfg.chunk_tokens):
        ids = prompt + repeat[start:start + cfg.chunk_tokens]
        pos = torch.arange(n, n + len(ids), device=dev)[None]
        base(input_ids=torch.tensor([ids], device=dev), position_ids=pos, use_cache=False, **{STEP_KWARG: step})
    return scores
