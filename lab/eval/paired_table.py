"""A markdown table of two models' `kvstash eval --output` files, cell by cell, paired on the same samples.

    python -m lab.eval.paired_table --a rat_{task}_{length}.json --b plain_{task}_{length}.json \
        --tasks niah_single_noise niah_multivalue --lengths 4096 8192 --suffix "" --suffix _snapkv

Each cell gives the score as k/n (n samples; k the sum of per-sample scores, which is fractional on tasks with
partial credit), its 95 % Wilson interval, the read fraction, and how many samples the first model scores higher
and lower than the second. The first model's cell is bold where its interval lies above the second's, italic
where below.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.eval.intervals import wilson


@dataclass(frozen=True)
class Cell:
    """One (method, budget) row of one eval file."""

    method: str
    budget: str
    scores: tuple[float, ...]
    read: float

    @property
    def k(self) -> float:
        """Sum of the per-sample scores."""
        return sum(self.scores)


def _budget(row: dict) -> str:
    if row.get("budget_tokens"):
        return f"{row['budget_tokens']:,}"
    if row.get("budget"):
        return f"1/{round(1 / row['budget'])}" if 1 / row["budget"] == round(1 / row["budget"]) else str(row["budget"])
    if row.get("ratio"):
        return f"ratio {row['ratio']}"
    return "—"


def cells(path: Path) -> list[Cell]:
    """The rows of one eval output file, in its order."""
    rows = json.loads(path.read_text())["rows"]
    return [Cell(r["method"], _budget(r), tuple(float(s) for s in r["scores"]), float(r["read_fraction"]))
            for r in rows]


def _fmt(c: Cell) -> str:
    lo, hi = wilson(c.k, len(c.scores))
    k = f"{c.k:g}" if c.k == int(c.k) else f"{c.k:.2f}"
    return f"{k}/{len(c.scores)} [{lo:.2f}, {hi:.2f}]"


def paired_rows(task: str, a: Sequence[Cell], b: Sequence[Cell]) -> list[str]:
    """Markdown rows pairing model A's cells with model B's (same method and budget, same samples)."""
    by_key = {(c.method, c.budget): c for c in b}
    out = []
    for ca in a:
        cb = by_key.get((ca.method, ca.budget))
        if cb is None or len(cb.scores) != len(ca.scores):
            raise ValueError(f"{task} {ca.method} {ca.budget}: no cell with the same samples in the second file")
        higher = sum(x > y for x, y in zip(ca.scores, cb.scores))
        lower = sum(x < y for x, y in zip(ca.scores, cb.scores))
        (alo, ahi), (blo, bhi) = wilson(ca.k, len(ca.scores)), wilson(cb.k, len(cb.scores))
        # bold: A's interval lies above B's; italic: below
        sa = f"**{_fmt(ca)}**" if alo > bhi else f"*{_fmt(ca)}*" if ahi < blo else _fmt(ca)
        out.append(f"| {task} | {ca.method} | {ca.budget} | {sa} | {ca.read:.3f} | {_fmt(cb)} | {cb.read:.3f} | "
                   f"{higher} / {lower} |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Print one table per length."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="first model's files, with {task} and {length} in the pattern")
    ap.add_argument("--b", required=True, help="second model's files, the same pattern")
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--lengths", nargs="+", type=int, required=True)
    ap.add_argument("--suffix", action="append", default=None,
                    help="file name suffixes before .json read for each cell (repeatable; default: none)")
    ap.add_argument("--names", nargs=2, default=("A", "B"), help="column names of the two models")
    args = ap.parse_args(argv)
    suffixes = args.suffix or [""]
    for length in args.lengths:
        print(f"#### {length // 1024}k\n")
        print(f"| task | method | budget | {args.names[0]} | read | {args.names[1]} | read | paired: "
              f"{args.names[0]} higher / lower |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for task in args.tasks:
            for suf in suffixes:
                pa = Path(args.a.format(task=task, length=length).removesuffix(".json") + suf + ".json")
                pb = Path(args.b.format(task=task, length=length).removesuffix(".json") + suf + ".json")
                print("\n".join(paired_rows(task, cells(pa), cells(pb))))
        print()


if __name__ == "__main__":
    main()
