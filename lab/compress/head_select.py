"""HybridKV stage 1: rank a model's KV heads by reconstruction score on calibration documents, once.

``python -m lab.compress.head_select --model models/kvstash-tiny`` prefills each calibration document,
scores it by context reconstruction on every head (``workers.methods.reconstruct``), keeps per head the
largest token score over all documents (the paper's ``s_{l,h} = max(s_{l,h}, max_i S_{l,h}(i))``) and
writes ``hybridkv_heads.json`` beside the weights; the loader folds its digest into the fingerprint.
Documents come from the synthetic suite's training split (never the held-out eval split).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from lab.synth import SynthContext, generate
from workers.methods.head_scores import DEFAULT_HEAD_FRACTION, HEADS_FILE, HeadScores
from workers.methods.reconstruct import reconstruction_scores
from workers.model import LoadedModel, load_model
from workers.prefill import prefill_kv

CALIBRATION_TASKS = ("niah_multikey", "vt", "repeat", "cwe", "niah_multivalue")
"""Whose documents calibrate (needle, tracking, plain-text and word-list haystacks alike)."""
CALIBRATION_SEED = 7_000
SINK_TOKENS = 4
"""Leading tokens left out of a head's statistic: every head parks attention on them (sinks), which would
make every head's maximum about 1 and the ranking meaningless."""


def head_maxima(lm: LoadedModel, documents: Sequence[str], skip: int = SINK_TOKENS) -> torch.Tensor:
    """``[layers, kv_heads]``: the largest reconstruction score each head gives any non-sink token, over
    ``documents``."""
    best = torch.zeros(lm.layout.n_layers, lm.layout.n_kv_heads)
    for doc in documents:
        ids = list(lm.tokenizer(doc).input_ids)
        kv = [(k, v) for _, k, v in prefill_kv(lm, ids, progress=False)]
        scores = reconstruction_scores(lm, ids, kv)
        best = torch.maximum(best, scores[:, :, skip:].amax(dim=2).cpu())
    return best


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
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    lm = load_model(args.model, device=args.device, progress=False)
    best = head_maxima(lm, calibration_documents(lm, args.docs, args.length))
    heads = HeadScores(scores=tuple(tuple(round(float(x), 6) for x in row) for row in best.tolist()),
                       head_fraction=args.head_fraction,
                       calibration=f"{args.docs} training-split documents of {args.length} tokens "
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
