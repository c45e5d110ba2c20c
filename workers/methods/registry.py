"""The explicit registry of decode methods (no import-time discovery)."""

from __future__ import annotations

from store.errors import UnknownMethod
from workers.methods.base import Method, Summarizer
from workers.methods.doublep import DoubleP
from workers.methods.full import FullAttention
from workers.methods.quest import Quest
from workers.methods.sparse import with_phi
from workers.methods.topk import TopK

METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        FullAttention,
        TopK,
        Quest,
        DoubleP,
        with_phi(TopK),
        with_phi(Quest),
        with_phi(DoubleP),
    )
}


def get_method(name: str) -> Method:
    """An instance of the method called ``name``."""
    try:
        return METHODS[name]()
    except KeyError:
        raise UnknownMethod(f"unknown method {name!r}; choose one of {sorted(METHODS)}") from None


def prefill_summarizers() -> list[type[Summarizer]]:
    """Every summarizer any registered method needs, once each, in a stable order."""
    seen: dict[str, type[Summarizer]] = {}
    for method in METHODS.values():
        for s in method.summarizers:
            seen.setdefault(s.name, s)
    return [seen[n] for n in sorted(seen)]
