"""Artifact names of compressed caches (no torch: ``kvstash info`` lists them without loading a model).

A compression method stores up to two kinds of artifact on a prefix: its query-agnostic, ratio-free
token scores (``<scorer>.scores.v<version>``, computed once) and one compact cache per ratio
(``<method>.r<ratio>.v<version>``: the kept tokens' K/V per layer and KV head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RATIO_DECIMALS = 4
"""Ratios are rounded to this many decimals: 0.3 and 0.30001 name (and build) the same cache."""
PREFILL_SCORERS = ("kvzip", "hybridkv")
"""Methods whose query-agnostic scores a prefill may compute up front (``compress=``): the ones whose keep set
comes from a scoring pass. StreamingLLM needs no scores (its cache builds in milliseconds on first use) and the
recall tiers (``kvzip+quest``) reuse their base's scores, so naming the base is enough."""
_CACHE = re.compile(r"^(?P<method>[a-z0-9_+-]+)\.r(?P<ratio>[0-9.]+)\.v(?P<version>[0-9]+)$")


def canonical_ratio(ratio: float) -> float:
    """The ratio a cache is built and named for."""
    return round(float(ratio), RATIO_DECIMALS)


def scores_artifact(scorer: str, version: int) -> str:
    """Name of a scorer's per-token scores artifact."""
    return f"{scorer}.scores.v{version}"


def cache_artifact(method: str, ratio: float, version: int) -> str:
    """Name of a method's compact cache at ``ratio``."""
    return f"{method}.r{canonical_ratio(ratio):.{RATIO_DECIMALS}f}.v{version}"


@dataclass(frozen=True)
class CompressedCacheName:
    """What a compact-cache artifact name says."""

    method: str
    ratio: float
    version: int


def parse_cache_artifact(name: str) -> CompressedCacheName | None:
    """The method, ratio and version a compact-cache artifact name encodes (None for other artifacts)."""
    m = _CACHE.match(name)
    if m is None:
        return None
    try:
        return CompressedCacheName(m["method"], float(m["ratio"]), int(m["version"]))
    except ValueError:
        return None
