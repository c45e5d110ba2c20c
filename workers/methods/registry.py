"""The explicit registry of decode methods (no import-time discovery)."""

from __future__ import annotations

from collections.abc import Collection

from store.errors import UnknownMethod
from workers.methods.base import Method, Summarizer
from workers.methods.compressed import CompressionMethod
from workers.methods.doublep import DoubleP, DoublePPhi
from workers.methods.full import FullAttention
from workers.methods.head_scores import HeadScores
from workers.methods.hybridkv import HybridKV
from workers.methods.kvzip import KVzip
from workers.methods.lookahead import LookaheadKV, LookaheadModel
from workers.methods.moba import Moba
from workers.methods.phi import PhiSummarizer
from workers.methods.phi_maps import FeatureMap
from workers.methods.quest import Quest, QuestPhi
from workers.methods.recall import HybridKVQuest, KVzipQuest, RecallTier
from workers.methods.snapkv import SnapKV
from workers.methods.sparse import SparseMethod
from workers.methods.streamingllm import StreamingLLM
from workers.methods.topk import TopK, TopKExact, TopKExactPhi, TopKIndexRemainder, TopKPhi, TopKToken

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        FullAttention,
        TopK,
        Quest,
        Moba,
        DoubleP,
        TopKPhi,
        TopKIndexRemainder,
        QuestPhi,
        DoublePPhi,
        TopKExact,
        TopKExactPhi,
        TopKToken,
        SnapKV,
        LookaheadKV,
        KVzip,
        HybridKV,
        StreamingLLM,
        KVzipQuest,
        HybridKVQuest,
    )
}

QUERY_TIME = frozenset({SnapKV.name, LookaheadKV.name})
"""Methods that build a query-time cache (sized by ``budget_tokens``; no per-step page fetch)."""
NEEDS_ADAPTER = frozenset({LookaheadKV.name})
"""Methods that run trained parts shipped beside the model's weights (refused for a model without them)."""

def get_method(name: str, phi_map: FeatureMap | None = None, lookahead: LookaheadModel | None = None,
               head_scores: HeadScores | None = None) -> Method:
    """An instance of the method called ``name`` (φ-completed ones use the model's distilled
    ``phi_map`` when it has one, else FAVOR+; ``lookahead`` runs the model's trained lookahead parts;
    HybridKV uses the model's shipped ``head_scores``)."""
    if name not in METHODS:
        raise UnknownMethod(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    method = LookaheadKV(lookahead) if name == LookaheadKV.name else METHODS[name]()
    if phi_map is not None and isinstance(method, SparseMethod) and method.completion:
        method.feature_map = phi_map
    target = method.base if isinstance(method, RecallTier) else method
    if isinstance(target, HybridKV):
        target.heads = head_scores
    return method


def compression_methods() -> list[str]:
    """Names of the methods that decode a compressed cache (they take a ``ratio``)."""
    return [n for n, m in METHODS.items() if issubclass(m, CompressionMethod)]


def prefill_summarizers() -> list[type[Summarizer]]:
    """Every summarizer any registered method needs, once each, in a stable order."""
    seen: dict[str, type[Summarizer]] = {}
    for method in METHODS.values():
        for s in method.summarizers:
            seen.setdefault(s.name, s)
    return [seen[n] for n in sorted(seen)]


def build_summarizer(kind: type[Summarizer], phi_map: FeatureMap | None = None) -> Summarizer:
    """An instance of summarizer ``kind``; the φ cache is built with the model's ``phi_map`` when given."""
    return kind(phi_map) if issubclass(kind, PhiSummarizer) else kind()


def build_summarizers(phi_map: FeatureMap | None = None, *,
                      skip: Collection[type[Summarizer]] = ()) -> list[Summarizer]:
    """Instances of `prefill_summarizers` but those in ``skip``, each with `build_summarizer`."""
    return [build_summarizer(s, phi_map) for s in prefill_summarizers() if s not in skip]
