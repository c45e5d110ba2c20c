"""HybridKV stage 1: rank a model's KV heads by reconstruction score on calibration documents, once.

``python -m lab.compress.head_select --model models/kvstash-tiny`` prefills each calibration document,
scores it by context reconstruction on every head (``workers.methods.reconstruct``) and ranks the heads
by one of two statistics (``--statistic``):

- ``max``, the paper's: per head the largest token score over all documents
  (``s_{l,h} = max(s_{l,h}, max_i S_{l,h}(i))``);
- ``share``: per head the fraction of KVzip's keep set at ``--share-ratio`` (the global top of all heads'
  token scores) that falls in the head, averaged over the documents. The paper's premise is that
  reconstruction importance concentrates on a few heads; ``max`` detects that only while it does not
  saturate. On the shipped model it does: every head gives some token a score of 0.92-1.00, so the ranking
  is decided in the third decimal, while 8 of 16 heads hold 90 % of KVzip's keep set at 0.3. The shipped
  ranking is still the paper's: with ``share`` HybridKV also collapses on vt and gains on fwe only
  (docs/benchmarks/compression.md, "HybridKV's head statistic").

It writes ``hybridkv_heads.json`` beside the weights. Documents come from the synthetic suite's training
split (never the held-out eval split).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from lab.synth import SynthContext, generate
from workers.methods.head_scores import DEFAULT_HEAD_FRACTION, HEADS_FILE, STATISTICS, HeadScores
from workers.methods.reconstruct import reconstruction_scores
from workers.model import LoadedModel, load_model
from workers.prefill import prefill_kv

CALIBRATION_TASKS = ("niah_multikey", "vt", "repeat", "cwe", "niah_multivalue")
"""Whose documents calibrate (needle, tracking, plain-text and word-list haystacks alike)."""
CALIBRATION_SEED = 7_000
SINK_TOKENS = 4
"""Leading tokens left out of a head's statistic: every head parks attention on them (sinks), which would
make every head's maximum about 1 and the ranking meaningless."""


def document_scores(lm: LoadedModel, documents: Sequence[str], skip: int = SINK_TOKENS) -> Iterator[torch.Tensor]:
    """Each document's reconstruction scores on every head, sinks left out: ``[layers, kv_heads, n - skip]`` (CPU)."""
    for doc in documents:
        ids = list(lm.tokenizer(doc).input_ids)
        kv = [(k, v) for _, k, v in prefill_kv(lm, ids, progress=False)]
        yield reconstruction_scores(lm, ids, kv)[:, :, skip:].cpu()


def head_maxima(lm: LoadedModel, documents: Sequence[str], skip: int = SINK_TOKENS) -> torch.Tensor:
    """``[layers, kv_heads]``: the largest reconstruction score each head gives any non-sink token, over
    ``documents``."""
    best = torch.zeros(lm.layout.n_layers, lm.layout.n_kv_heads)
    for scores in document_scores(lm, documents, skip):
        best = torch.maximum(best, scores.amax(dim=2))
    return best


def head_shares(lm: LoadedModel, documents: Sequence[str], ratio: float, skip: int = SINK_TOKENS) -> torch.Tensor:
    """``[layers, kv_heads]``: the mean over ``documents`` of the fraction of the ``ratio`` highest non-sink token
    scores (all heads together: KVzip's keep set at ``ratio``) that each head holds."""
    total = torch.zeros(lm.layout.n_layers, lm.layout.n_kv_heads)
    for scores in document_scores(lm, documents, skip):
        total += keep_share(scores, ratio)
    return total / max(1, len(documents))


def keep_share(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Scores ``[layers, kv_heads, n]`` -> each head's fraction of the global top ``ratio`` of all scores."""
    flat = scores.flatten()
    k = max(1, min(flat.numel(), round(ratio * flat.numel())))
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept[flat.topk(k).indices] = True
    return kept.view(scores.shape).sum(-1).float() / k


def calibration_documents(lm: LoadedModel, n_docs: int, length: int) -> list[str]:
    """``n_docs`` training-split documents of about ``length`` tokens, cycling through the tasks."""
    ctx = SynthContext(tokenizer=lm.tokenizer, split="train")
    return [generate(CALIBRATION_TASKS[i % len(CALIBRATION_TASKS)], length, CALIBRATION_SEED + i, ctx).document
            for i in range(n_docs)]


def main(argv: Sequence[str] | None = None) -> None:
    """Write ``hybridkv_heads.json`` for a model."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local model folder (the file is written into it)")
    p.add_argument("--docs", type=int, default=10, help="calibration documents (the paper: 10)")
    p.add_argument("--length", type=int, default=2048, help="tokens per document")
    p.add_argument("--head-fraction", type=float, default=DEFAULT_HEAD_FRACTION, help="k, heads kept (0.5)")
    p.add_argument("--statistic", choices=STATISTICS, default="max", help="how heads are ranked (see above)")
    p.add_argument("--share-ratio", type=float, default=0.3, help="KVzip's ratio whose keep set `share` counts")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    lm = load_model(args.model, device=args.device, progress=False)
    if not 0 < args.share_ratio <= 1:
        raise SystemExit("--share-ratio must be in (0, 1]")
    docs = calibration_documents(lm, args.docs, args.length)
    if args.statistic == "share":
        best = head_shares(lm, docs, args.share_ratio)
        how = f"share of KVzip's keep set at ratio {args.share_ratio}"
    else:
        best = head_maxima(lm, docs)
        how = "largest token score"
    heads = HeadScores(scores=tuple(tuple(round(float(x), 6) for x in row) for row in best.tolist()),
                       head_fraction=args.head_fraction, statistic=args.statistic,
                       calibration=f"{how}; {args.docs} training-split documents of {args.length} tokens "
                                   f"({', '.join(CALIBRATION_TASKS)}), seeds from {CALIBRATION_SEED}, "
                                   f"first {SINK_TOKENS} tokens left out")
    out = Path(args.model) / HEADS_FILE
    out.write_text(heads.to_json())
    kept = heads.top(heads.head_fraction)
    print(f"wrote {out}")
    for layer, row in enumerate(best.tolist()):
        print(f"layer {layer}: " + "  ".join(f"{x:.3f}{'*' if kept[layer][h] else ' '}" for h, x in enumerate(row)))


if __name__ == "__main__":
    main()
