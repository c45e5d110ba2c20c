"""Realism check for the model card: greedy accuracy when each decode-time query attends only to
its oracle top-k document keys, next to full attention.

    python -m lab.train.oracle_topk --model models/kvstash-tiny --length 2048 --fractions 1 0.05 0.02 0.01

The document is prefilled with full attention; the query and the answer tokens then attend to a
budget of document keys plus every query/answer token (resident tail). Two selections:

- ``kv-head`` (default; the paper's Lane A "Sink + Tail + Top-K" and the product's `topk`): a
  budget of n(f) = ceil(f N) token equivalents per KV head, of which the sink and tail anchors
  take theirs and the rest, k_topk = n(f) - sink - tail (eq. 14), are the mid tokens with the most
  group-mean attention mass (exhaustive, exact scores), shared by the KV head's query heads.
- ``query-head``: every query head keeps its own top ceil(f N) document keys, anchors not charged
  (with 4 query heads per KV head this reads up to 4x the budget per KV head).

With full attention it also records H_mid (the mid-region normalized entropy of appendix H,
eq. 52) of every layer and query head at the last query token, the one that predicts the first
answer token: the entropy of the attention restricted to the document minus its first `sink`
and last `tail` tokens, divided by log(mid-region length); 0 = one key, 1 = uniform.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoTokenizer, DynamicCache, LlamaForCausalLM

from lab.synth import PROMPT, Sample, SynthContext, generate
from workers.budget import k_topk, n_budget
from workers.methods.base import mid_range
from workers.methods.selector import group_mass
from workers.requests import DecodeConfig

ATTN_NAME = "oracle_topk"
ANSWER_SLACK_TOKENS = 8
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "compare")
SELECTIONS = ("kv-head", "query-head")


ANCHORS = DecodeConfig()
"""Sink and tail sizes that bound the mid region (the runtime's defaults)."""


@dataclass
class TopK:
    """What the attention function reads: document length, kept fraction (1.0 = full) and how
    keys are selected; while `record` is set, each layer appends its H_mid per query head to `entropy`."""

    doc_len: int = 0
    fraction: float = 1.0
    selection: str = "kv-head"
    record: bool = False
    entropy: list[torch.Tensor] = field(default_factory=list)


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
    if STATE.record and q_len < k_len and n_doc > 0:
        STATE.entropy.append(mid_entropy(scores[0, :, -1, :n_doc]))
    if q_len < k_len and STATE.fraction < 1.0 and n_doc > 0:
        keep = (kv_head_keep if STATE.selection == "kv-head" else query_head_keep)(scores[..., :n_doc], groups)
        scores[..., :n_doc] = scores[..., :n_doc].masked_fill(~keep, -math.inf)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, topk_attention)


def query_head_keep(doc: torch.Tensor, groups: int) -> torch.Tensor:
    """Mask of each query head's own top ceil(f N) document keys, from logits [B, Hq, T, N]."""
    budget = max(1, math.ceil(STATE.fraction * doc.shape[-1]))
    threshold = doc.topk(budget, dim=-1).values[..., -1:]
    return doc >= threshold


def kv_head_keep(doc: torch.Tensor, groups: int) -> torch.Tensor:
    """Mask of the sink and tail anchors plus each KV head's k_topk mid keys by group-mean
    attention mass (the paper's token-equivalent budget), from logits [B, Hq, T, N]."""
    n = doc.shape[-1]
    lo, hi = mid_range(n, ANCHORS.sink, ANCHORS.tail)
    keep = torch.ones_like(doc, dtype=torch.bool)
    k = min(hi - lo, k_topk(n_budget(STATE.fraction, n), ANCHORS.sink, ANCHORS.tail))
    mid = doc[..., lo:hi]
    b, hq, t, m = mid.shape
    mass = group_mass(mid.reshape(b, hq // groups, groups, t, m).transpose(2, 3))  # [B, Hkv, T, M]
    chosen = torch.zeros_like(mass, dtype=torch.bool)
    if k > 0:
        chosen.scatter_(-1, mass.topk(k, dim=-1).indices, True)
    keep[..., lo:hi] = chosen.repeat_interleave(groups, dim=1)
    return keep


def mid_entropy(scores: torch.Tensor) -> torch.Tensor:
    """H_mid per head from [heads, n_doc] document logits (the mid region is renormalized alone)."""
    lo, hi = mid_range(scores.shape[-1], ANCHORS.sink, ANCHORS.tail)
    if hi - lo < 2:
        return scores.new_zeros(scores.shape[0])
    logp = torch.log_softmax(scores[:, lo:hi].double(), dim=-1)
    return (-(logp.exp() * logp).sum(-1) / math.log(hi - lo)).float().cpu()


@torch.no_grad()
def prefill(model, tok, sample: Sample) -> DynamicCache:
    """The document's cache, with full attention."""
    doc = torch.tensor([tok(sample.document).input_ids], device=model.device)
    STATE.doc_len, STATE.fraction = doc.shape[1], 1.0
    cache = DynamicCache()
    model(doc, past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def answer(model, tok, sample: Sample, fraction: float, cache: DynamicCache, record: bool = False) -> str:
    """Greedy answer over a prefilled document `cache` with top-k decode (the cache is cropped back
    to the document after); with `record`, STATE.entropy gets one [heads] H_mid per layer for the
    query's last token."""
    dev = model.device
    n_doc = cache.get_seq_length()
    query = torch.tensor([tok(sample.query, add_special_tokens=False).input_ids], device=dev)
    STATE.doc_len, STATE.fraction = n_doc, fraction
    STATE.record, STATE.entropy = record, []
    try:
        logits = model(query, past_key_values=cache, use_cache=True).logits[:, -1]
    finally:
        STATE.record = False
    out: list[int] = []
    budget = len(tok(sample.target, add_special_tokens=False).input_ids) + ANSWER_SLACK_TOKENS
    for _ in range(budget):
        nxt = int(logits.argmax(-1))
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True).logits[:, -1]
    cache.crop(n_doc)
    return PROMPT.clean(tok.decode(out))


def evaluate_task(model, tok, samples: list[Sample], fractions: list[float]) -> dict:
    """Mean score per fraction, and H_mid at the full-attention answer position (mean, per layer)."""
    totals = dict.fromkeys(map(str, fractions), 0.0)
    per_sample: list[torch.Tensor] = []
    for s in samples:
        cache = prefill(model, tok, s)
        for f in fractions:
            totals[str(f)] += s.score(answer(model, tok, s, f, cache, record=f >= 1.0))
            if f >= 1.0:
                per_sample.append(torch.stack(STATE.entropy))  # [layers, heads]
    out: dict = {"accuracy": {f: t / len(samples) for f, t in totals.items()}}
    if per_sample:
        h = torch.stack(per_sample)  # [samples, layers, heads]
        out["h_mid"] = round(float(h.mean()), 4)
        out["h_mid_layers"] = [round(float(x), 3) for x in h.mean(dim=(0, 2))]
        out["h_mid_above_half"] = round(float((h > 0.5).float().mean()), 4)
    return out


def main() -> None:
    """CLI entry point; prints accuracy per task and fraction (and H_mid) as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.05, 0.02, 0.01])
    p.add_argument("--tasks", nargs="*", default=list(DEFAULT_TASKS))
    p.add_argument("--selection", choices=SELECTIONS, default="kv-head", help="how keys are kept (module doc)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=ATTN_NAME)
    model = model.to(args.device).eval()  # fp32 everywhere: exact top-k
    tok = AutoTokenizer.from_pretrained(args.model)
    ctx = SynthContext(tok, "eval")
    STATE.selection = args.selection
    table: dict[str, dict] = {}
    for task in args.tasks:
        samples = [generate(task, args.length, seed, ctx) for seed in range(args.samples)]
        table[task] = evaluate_task(model, tok, samples, args.fractions)
        print(json.dumps({task: table[task]}), flush=True)
    result = {
        "model": args.model,
        "length": args.length,
        "samples": args.samples,
        "device": args.device,
        "selection": args.selection,
        "sink": ANCHORS.sink,
        "tail": ANCHORS.tail,
        "tasks": table,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
