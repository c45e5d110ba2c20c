"""SnapKV at query time: the query (the observation window) picks the prefix entries the rest of the answer attends.

The query's tokens attend the whole stored prefix once; their attention, summed over the query,
max-pooled over positions and averaged over each GQA group, ranks the prefix per KV head, and the
top ``budget_tokens`` (sink and tail anchors included) are all that later steps read.
"""

from __future__ import annotations

from workers.attention import PrefixAttention
from workers.methods.base import Method
from workers.methods.keep_set import DEFAULT_BUDGET_TOKENS, KeepConfig, QueryTimeAttention
from workers.methods.source import PrefixSource
from workers.requests import DecodeConfig


def keep_config(config: DecodeConfig) -> KeepConfig:
    """The keep-set settings a request asks for (``budget_tokens``, sink and tail)."""
    budget = config.budget_tokens if config.budget_tokens is not None else DEFAULT_BUDGET_TOKENS
    return KeepConfig(budget_tokens=budget, sink=config.sink, tail=config.tail)


class SnapKV(Method):
    """A query-time cache of ``budget_tokens`` entries per KV head, chosen by the query's attention."""

    name = "snapkv"
    fetches_pages = True  # its query step's whole-layer reads go through the worker's tiers

    def open(self, source: PrefixSource, config: DecodeConfig) -> PrefixAttention:
        """State for one generation (the prefix is read when the query first attends it)."""
        return QueryTimeAttention(source, keep_config(config), observe_query=True)
