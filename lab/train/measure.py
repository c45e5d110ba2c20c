"""Full-attention accuracy of a model on the held-out task suite (plain transformers, greedy).

python -m lab.train.measure --model models/kvstash-tiny --lengths 2048 --samples 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from lab.synth import NIAH_TASKS, PROMPT, TASKS, Sample, SynthContext, generate

ANSWER_SLACK_TOKENS = 8
MAX_REPEAT_LENGTH = 4096
"""Longer reconstruction samples are skipped (their greedy answer is as long as the document)."""


def load(model_dir: Path, device: str) -> tuple[LlamaForCausalLM, object]:
    """Model (bf16 on GPU, fp32 on CPU) and tokenizer."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)  # type: ignore[arg-type]
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def answer(model, tok, sample: Sample, device: str) -> str:
    """Greedy completion of document + query, cut at the prompt format's stop strings."""
    doc = tok(sample.document).input_ids
    query = tok(sample.query, add_special_tokens=False).input_ids
    ids = torch.tensor([doc + query], device=device)
    budget = len(tok(sample.target, add_special_tokens=False).input_ids) + ANSWER_SLACK_TOKENS
    out = model.generate(
        ids, max_new_tokens=budget, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return PROMPT.clean(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def evaluate(model, tok, tasks: list[str], lengths: list[int], samples: int, device: str) -> dict:
    """Accuracy per length and task (mean RULER score), plus the NIAH average per length."""
    ctx = SynthContext(tok, "eval")
    table: dict[str, dict[str, float]] = {}
    for n in lengths:
        row = {}
        for task in tasks:
            if task == "repeat" and n > MAX_REPEAT_LENGTH:
                continue
            scores = [
                (s := generate(task, n, seed, ctx)).score(answer(model, tok, s, device)) for seed in range(samples)
            ]
            row[task] = sum(scores) / len(scores)
        niah = [row[t] for t in NIAH_TASKS if t in row]
        if niah:
            row["niah_average"] = sum(niah) / len(niah)
        table[str(n)] = row
    return table


def main(argv: list[str] | None = None) -> None:
    """CLI entry point; prints one JSON object."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--lengths", nargs="*", type=int, default=[2048])
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load(args.model, device)
    t0 = time.time()
    result = {
        "model": str(args.model),
        "samples": args.samples,
        "accuracy": evaluate(model, tok, args.tasks, args.lengths, args.samples, device),
        "seconds": round(time.time() - t0, 1),
    }
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
