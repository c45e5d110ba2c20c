"""HybridKV's offline head ranking: a per-(layer, KV head) statistic of the reconstruction scores on
calibration documents, computed once per model (``python -m lab.compress.head_select``) and shipped
beside the weights as ``hybridkv_heads.json`` (its digest names the scores it makes)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

HEADS_FILE = "hybridkv_heads.json"
FORMAT = 1
DEFAULT_HEAD_FRACTION = 0.5
"""The paper's k: the fraction of heads scored token by token (the rest are pruned)."""
STATISTICS = ("max", "share")
"""How a head is scored: ``max``, the paper's (the largest token score it gives over the documents);
``share``, the mean fraction of KVzip's keep set (the global top ``share_ratio`` of token scores) it holds."""


@dataclass(frozen=True, kw_only=True)
class HeadScores:
    """Calibration score of every (layer, KV head) and the head-retention fraction k."""

    scores: tuple[tuple[float, ...], ...]
    """``[layers][kv_heads]``: the head's calibration statistic (higher: kept first)."""
    head_fraction: float = DEFAULT_HEAD_FRACTION
    statistic: str = "max"
    """Which statistic ``scores`` holds (``STATISTICS``)."""
    calibration: str = ""
    """How the scores were made (documents, lengths, seed), for the record."""

    def __post_init__(self) -> None:
        if not self.scores or len({len(r) for r in self.scores}) != 1:
            raise ValueError("head scores must be a non-empty [layers][kv_heads] table")
        if not 0 < self.head_fraction <= 1:
            raise ValueError("head_fraction must be in (0, 1]")
        if self.statistic not in STATISTICS:
            raise ValueError(f"unknown head statistic {self.statistic!r} (known: {', '.join(STATISTICS)})")

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, kv_heads)."""
        return len(self.scores), len(self.scores[0])

    def top(self, fraction: float) -> list[list[bool]]:
        """The ``fraction`` of heads (at least one) with the highest calibration scores."""
        flat = sorted(((s, i) for i, s in enumerate(x for row in self.scores for x in row)), reverse=True)
        n = max(1, min(len(flat), math.ceil(fraction * len(flat) - 1e-9)))
        chosen = {i for _, i in flat[:n]}
        n_heads = self.shape[1]
        return [[(layer * n_heads + h) in chosen for h in range(n_heads)] for layer in range(self.shape[0])]

    def to_json(self) -> str:
        """The shipped file's text."""
        d = {"format": FORMAT, "head_fraction": self.head_fraction, "calibration": self.calibration,
             "scores": [list(r) for r in self.scores]}
        if self.statistic != "max":  # files written before the statistic was recorded hold the paper's
            d["statistic"] = self.statistic
        return json.dumps(d, indent=1) + "\n"

    @property
    def digest(self) -> str:
        """Hash of the file's content (joins the model fingerprint)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> HeadScores:
        """Parse ``to_json``'s text."""
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"unsupported {HEADS_FILE} format {d.get('format')!r}")
        return cls(scores=tuple(tuple(float(x) for x in r) for r in d["scores"]),
                   head_fraction=float(d.get("head_fraction", DEFAULT_HEAD_FRACTION)),
                   calibration=str(d.get("calibration", "")), statistic=str(d.get("statistic", "max")))


def load_head_scores(model_dir: str | Path) -> HeadScores | None:
    """The head ranking shipped in a local model folder, or None when it has none."""
    path = Path(model_dir) / HEADS_FILE
    if not path.is_file():
        return None
    return HeadScores.from_json(path.read_text())
