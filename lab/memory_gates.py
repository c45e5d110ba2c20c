"""CLI: how open a RAT+ model's memory gates are on held-out text (issue 17).

python -m lab.memory_gates models/kvstash-tiny-rat [--tokens 2048] [--json OUT]

Per layer, over every token and KV channel of the text: the mean, median and 99th percentile of the gate g and
the effective memory length 1 / (1 − mean g) (1 token: no memory; the paper's RAT+ reaches about 64).
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import workers.ratplus  # noqa: F401 - registers the RAT+ model type with the Auto classes
from lab.synth.corpus import HELDOUT_FILE
from workers.ratplus.modeling import MemoryGate

DEFAULT_TOKENS = 2048
"""Tokens of held-out text the gates are read over."""


def gate_stats(model: torch.nn.Module, ids: torch.Tensor) -> list[dict[str, float]]:
    """Per layer (in order): mean, median, p99 of the gates over ``ids`` ``[1, T]``, and 1 / (1 − mean)."""
    gates = [m for m in model.modules() if isinstance(m, MemoryGate)]
    if not gates:
        raise SystemExit("this model has no memory gates (not a RAT+ model)")
    seen: dict[int, torch.Tensor] = {}
    hooks = [g.register_forward_hook(lambda mod, _inp, out, i=i: seen.__setitem__(i, out.detach().float().flatten()))
             for i, g in enumerate(gates)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i in range(len(gates)):
        g = seen[i]
        mean = float(g.mean())
        out.append({"layer": i, "mean": mean, "median": float(g.median()),
                    "p99": float(torch.quantile(g[: 1 << 24], 0.99)), "effective_length": 1.0 / (1.0 - mean)})
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    text = lzma.decompress(HELDOUT_FILE.read_bytes()).decode()
    ids = torch.tensor([tok(text).input_ids[: args.tokens]])
    rows = gate_stats(model, ids)
    print("| layer | mean g | median | p99 | effective length |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['mean']:.3f} | {r['median']:.3f} | {r['p99']:.3f} | {r['effective_length']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "tokens": int(ids.shape[1]), "layers": rows}))


if __name__ == "__main__":
    main()
