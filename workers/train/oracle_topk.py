"""Realism check for the model card: greedy accuracy when each decode-time query attends only to
its oracle top-k document keys (per query head), next to full attention.

    python -m workers.train.oracle_topk --model models/kvstash-tiny --length 2048 --fractions 1 0.05 0.01

The document is prefilled with full attention; the query and the answer tokens then attend to
the top `fraction` of document keys by exact score, plus every query/answer token (resident tail).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoTokenizer, DynamicCache, LlamaForCausalLM

from workers.synth import PROMPT, Sample, SynthContext, generate

ATTN_NAME = "oracle_topk"
ANSWER_SLACK_TOKENS = 8
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


@dataclass
class TopK:
    """What the attention function reads: document length and kept fraction (1.0 = full)."""

    doc_len: int = 0
    fraction: float = 1.0


STATE = TopK()


def topk_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention; rows past the document keep only their top-k document keys."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = (query @ k.transpose(-1, -2)).float() * (scaling or query.shape[-1] ** -0.5)
    q_len, k_len = scores.shape[-2:]
    pos_q = torch.arange(k_len - q_len, k_len, device=scores.device)
    causal = torch.arange(k_len, device=scores.device)[None, :] <= pos_q[:, None]
    scores = scores.masked_fill(~causal, -math.inf)
    n_doc = STATE.doc_len
    if q_len < k_len and STATE.fraction < 1.0 and n_doc > 0:
        budget = max(1, math.ceil(STATE.fraction * n_doc))
        doc = scores[..., :n_doc]
        threshold = doc.topk(budget, dim=-1).values[..., -1:]
        scores[..., :n_doc] = doc.masked_fill(doc < threshold, -math.inf)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, topk_attention)


@torch.no_grad()
def answer(model, tok, sample: Sample, fraction: float) -> str:
    """Greedy answer with full-attention prefill of the document and top-k decode."""
    doc = torch.tensor([tok(sample.document).input_ids])
    query = torch.tensor([tok(sample.query, add_special_tokens=False).input_ids])
    STATE.doc_len, STATE.fraction = doc.shape[1], fraction
    cache = DynamicCache()
    model(doc, past_key_values=cache, use_cache=True)
    logits = model(query, past_key_values=cache, use_cache=True).logits[:, -1]
    out: list[int] = []
    budget = len(tok(sample.target, add_special_tokens=False).input_ids) + ANSWER_SLACK_TOKENS
    for _ in range(budget):
        nxt = int(logits.argmax(-1))
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[:, -1]
    return PROMPT.clean(tok.decode(out))


def main() -> None:
    """CLI entry point; prints accuracy per task and fraction as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.05, 0.01])
    p.add_argument("--tasks", nargs="*", default=list(DEFAULT_TASKS))
    args = p.parse_args()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=ATTN_NAME).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    ctx = SynthContext(tok, "eval")
    table: dict[str, dict[str, float]] = {}
    for task in args.tasks:
        samples = [generate(task, args.length, seed, ctx) for seed in range(args.samples)]
        table[task] = {
            str(f): sum(s.score(answer(model, tok, s, f)) for s in samples) / len(samples) for f in args.fractions
        }
        print(json.dumps({task: table[task]}), flush=True)
    print(json.dumps({"length": args.length, "samples": args.samples, "accuracy": table}, indent=1))


if __name__ == "__main__":
    main()
