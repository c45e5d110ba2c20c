"""Head ablations behind HybridKV's variable-tracking collapse (issue 15): ``kvstash eval`` with extra
keep-rule methods registered for the run (no scores; ``--ratio`` is ignored by them).

``python -m bench.bench_hybridkv_ablate --variants drop1,pruned,pruned-sink,pruned-sw -- <eval args>``
registers, for the model's shipped ranking (``hybridkv_heads.json``):

- ``ab-drop-l<L>h<H>``: every head whole but (L, H), which keeps nothing (``drop1``; ``drop1s``: keeps
  only its ``SINK`` sinks, ``ab-drop-l<L>h<H>-s``);
- ``ab-pruned``: the ranking's retained heads whole, the pruned ones nothing (HybridKV strict at ratio k);
- ``ab-pruned-sink``: the same, the pruned heads keeping their ``SINK`` sinks;
- ``ab-pruned-sw<W>``: the same, the pruned heads keeping sinks and the last ``W`` tokens (``--windows``);
- ``ab-pruned-but-l<L>h<H>``: retained heads whole, every pruned head nothing but (L, H), kept whole
  (``restore1``: which single pruned head restores the task).

Then runs ``client.cli eval`` with ``--method`` for each registered variant added to the given arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import store.limits
from client import cli, cli_model
from workers.methods import registry
from workers.methods.compressed import CompressionMethod
from workers.methods.head_scores import load_head_scores

SINK = 4
MODEL = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"

Mask = Callable[[int, int, int], torch.Tensor]


def _method(name: str, mask: Mask) -> type[CompressionMethod]:
    def keep(self: CompressionMethod, scores: torch.Tensor | None, ratio: float, n_layers: int, n_kv_heads: int,
             n_tokens: int) -> torch.Tensor:
        return mask(n_layers, n_kv_heads, n_tokens)
    return type(f"Ablate_{name}", (CompressionMethod,), {"name": name, "version": 1, "scorer": None, "keep": keep})


def _anchors(n: int, sink: int, window: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[:min(sink, n)] = True
    if window:
        m[max(0, n - window):] = True
    return m


def variants(kinds: Sequence[str], windows: Sequence[int]) -> dict[str, Mask]:
    """Name -> keep-mask builder of every requested ablation."""
    ranking = load_head_scores(MODEL)
    assert ranking is not None
    retained = torch.tensor(ranking.top(ranking.head_fraction))
    n_l, n_h = retained.shape
    out: dict[str, Mask] = {}

    def with_heads(whole: torch.Tensor, sink: int = 0, window: int = 0) -> Mask:
        def mask(n_layers: int, n_kv_heads: int, n_tokens: int) -> torch.Tensor:
            keep = whole[:, :, None].expand(n_layers, n_kv_heads, n_tokens).clone()
            keep[~whole] = _anchors(n_tokens, sink, window)
            return keep
        return mask

    for kind in kinds:
        if kind in ("drop1", "drop1s"):
            for layer in range(n_l):
                for h in range(n_h):
                    whole = torch.ones(n_l, n_h, dtype=torch.bool)
                    whole[layer, h] = False
                    sfx = "-s" if kind == "drop1s" else ""
                    out[f"ab-drop-l{layer}h{h}{sfx}"] = with_heads(whole, SINK if sfx else 0)
        elif kind == "pruned":
            out["ab-pruned"] = with_heads(retained)
        elif kind == "pruned-sink":
            out["ab-pruned-sink"] = with_heads(retained, SINK)
        elif kind == "pruned-sw":
            for w in windows:
                out[f"ab-pruned-sw{w}"] = with_heads(retained, SINK, w)
        elif kind == "restore1":
            for layer, h in torch.nonzero(~retained).tolist():
                whole = retained.clone()
                whole[layer, h] = True
                out[f"ab-pruned-but-l{layer}h{h}"] = with_heads(whole)
        else:
            raise SystemExit(f"unknown variant kind {kind!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="drop1", help="comma-separated kinds (see above)")
    p.add_argument("--windows", default="60", help="comma-separated recent windows for pruned-sw")
    p.add_argument("--only", default="", help="comma-separated variant names to keep (default all)")
    p.add_argument("eval_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    found = variants(args.variants.split(","), [int(w) for w in args.windows.split(",")])
    if args.only:
        found = {n: m for n, m in found.items() if n in set(args.only.split(","))}
    # each variant's cache is close to the whole K/V: room for a few dozen of them (this process only)
    store.limits.DERIVED_ARTIFACT_FACTOR = max(store.limits.DERIVED_ARTIFACT_FACTOR, len(found) + 4)
    for name, mask in found.items():
        registry.METHODS[name] = _method(name, mask)
        cli_model.METHOD_HELP[name] = "ablation (bench.bench_hybridkv_ablate)"
    rest = [a for a in args.eval_args if a != "--"]
    return cli.main(["eval", *rest, *[x for n in found for x in ("--method", n)]])


if __name__ == "__main__":
    sys.exit(main())
