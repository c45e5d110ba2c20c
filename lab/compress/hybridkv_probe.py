"""Where the query's attention goes, per (layer, KV head), on ``kvstash eval``'s samples (issue 15: what the heads
HybridKV prunes carry for variable tracking).

``python -m lab.compress.hybridkv_probe --task vt --length 4096 --samples 0,1,2`` feeds document + query +
gold answer (teacher forcing) through the model once (CPU, float32) and, for the query and answer rows,
reports per KV head (query heads of its group averaged) the attention mass on the sinks (first 4 tokens),
the rest of the document, its last 60 tokens, the needle statements' tokens (vt), and the rows' own tokens;
and the entropy of the attention over the document in nats (log(n) = uniform). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lab.eval.accuracy import EVAL_SEED_BASE
from lab.synth import SynthContext, generate
from workers.model import load_model

SINK, WINDOW = 4, 60


def needle_positions(tok: Any, doc: str, ids: Sequence[int]) -> torch.Tensor:
    """Bool ``[len(ids)]``: tokens inside ``VAR ... .`` statements (by character offsets)."""
    enc = tok(doc, return_offsets_mapping=True)
    assert list(enc.input_ids) == list(ids)
    spans, start = [], 0
    while (i := doc.find("VAR ", start)) >= 0:
        j = doc.find(" .", i)
        spans.append((i, j + 2))
        start = j + 2
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for t, (a, b) in enumerate(enc.offset_mapping):
        mask[t] = any(a < e and b > s for s, e in spans) and b > a
    return mask


@torch.inference_mode()
def probe(lm: Any, doc_ids: list[int], rest_ids: list[int], needles: torch.Tensor) -> list[list[dict[str, float]]]:
    """Per layer, per KV head: the rows' attention statistics."""
    model, n = lm.model, len(doc_ids)
    captured: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def pre(mod: Any, args: Any, kwargs: Any, i: int = i) -> None:
            h = kwargs.get("hidden_states", args[0] if args else None)
            captured[i] = (h, kwargs["position_embeddings"])
        hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        model(torch.tensor([doc_ids + rest_ids]))
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        h, (cos, sin) = captured[i]
        d = att.head_dim
        q = att.q_proj(h).view(1, -1, att.config.num_attention_heads, d).transpose(1, 2)
        k = att.k_proj(h).view(1, -1, att.config.num_key_value_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q = q[:, :, n:]  # the query and answer rows
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * att.scaling  # [1, Hq, R, T]
        r, t = logits.shape[2], logits.shape[3]
        causal = torch.arange(t)[None, :] <= (n + torch.arange(r))[:, None]
        p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)[0]  # [Hq, R, T]
        doc = p[:, :, :n]
        pdoc = doc / doc.sum(-1, keepdim=True).clamp_min(1e-30)
        ent = -(pdoc * pdoc.clamp_min(1e-30).log()).sum(-1)  # [Hq, R]
        stats = {
            "sink": doc[:, :, :SINK].sum(-1), "document": doc[:, :, SINK:n - WINDOW].sum(-1),
            "last60": doc[:, :, n - WINDOW:].sum(-1), "needles": doc[:, :, needles].sum(-1),
            "own": p[:, :, n:].sum(-1), "doc_entropy": ent,
        }
        row = []
        for kvh in range(k.shape[1] // g):
            row.append({s: round(float(v[kvh * g:(kvh + 1) * g].mean()), 4) for s, v in stats.items()})
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/kvstash-tiny")
    p.add_argument("--task", default="vt")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", default="0,1,2")
    args = p.parse_args(argv)
    lm = load_model(args.model, dtype="float32", progress=False)
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    result: dict[str, Any] = {"args": vars(args), "samples": {}}
    for s in (int(x) for x in args.samples.split(",")):
        sample = generate(args.task, args.length, EVAL_SEED_BASE + s, ctx)
        ids = list(lm.tokenizer(sample.document).input_ids)
        rest = list(lm.tokenizer(sample.query + sample.target, add_special_tokens=False).input_ids)
        needles = needle_positions(lm.tokenizer, sample.document, ids)
        result["samples"][s] = {"n_document": len(ids), "n_rows": len(rest), "n_needle_tokens": int(needles.sum()),
                                "heads": probe(lm, ids, rest, needles)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
