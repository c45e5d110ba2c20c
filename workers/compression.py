"""Building compressed caches of stored prefixes: once per (prefix, method, ratio), on first use.

A prefill may also compute a method's scores right away (``ensure_scores``): the expensive pass then runs
at prefill time and the first generation at any ratio only compacts.

A generation with a compression method asks ``Compressions.ensure`` for its compact cache. Within one
worker a per-artifact lock makes concurrent requests wait for one build (single flight); across
workers the store's ``add_artifact`` keeps the first committed copy, and a later writer uses it. The
scores (query-agnostic, ratio-free) are an artifact of their own: a cache at another ratio reuses them.
"""

from __future__ import annotations

import time

import torch

from store.artifacts import bytes_to_tensors, tensors_to_bytes, tensors_to_chunks
from store.errors import InvalidInput
from store.kvstore import KVStore
from store.manifest import Manifest
from workers.methods.compressed import CompressionMethod, compact_cache
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.progress import PrefillProgress
from workers.single_flight import SingleFlight

TOKENS_ARTIFACT = "tokens"
"""The prefix's token ids, stored at prefill: reconstruction scoring repeats them."""
SCORES_KEY = "scores"
"""The tensor name inside a scores artifact (``[layers, kv_heads, n_tokens]`` float32)."""


class Compressions:
    """One worker's builder of compressed caches (thread-safe)."""

    def __init__(self, store: KVStore, lm: LoadedModel, *, progress: bool = False):
        self.store, self.lm, self.progress = store, lm, progress
        self._flights = SingleFlight()
        """Per (prefix, artifact) being built."""
        self.builds = 0
        """Compact caches this worker built (not counting those found committed)."""
        self.scorings = 0
        """Scoring passes this worker ran."""
        self.seconds: dict[str, float] = {}
        """Wall time of the last scoring (``score``) and compaction (``compact``)."""

    def ensure(self, manifest: Manifest, method: CompressionMethod, ratio: float) -> Manifest:
        """The prefix's manifest listing ``method``'s compact cache at ``ratio`` (built now if missing)."""
        name = method.cache_name(ratio)
        if manifest.artifact(name) is not None:
            return manifest
        pid = manifest.prefix_id
        base = method.base_method()
        if base is not None:  # built from the base's cache, which is ensured first (outside this build's lock)
            manifest = self.ensure(manifest, base, ratio)
        with self._flights.hold((pid, name)):
            m = self.store.manifest(pid)
            if m.artifact(name) is not None:  # another request (or worker) built it while we waited
                return m
            source = PrefixSource(self.store, m, self.lm.device)
            kv = [source.layer_kv(layer) for layer in range(m.layout.n_layers)]
            if base is not None:
                t0 = time.perf_counter()
                tensors = method.derive(source.artifact(base.cache_name(ratio)), kv, m.layout.page_size)
            else:
                scores = None
                if method.needs_scores(ratio) and (sname := method.scores_name()) is not None:
                    m, scores = self._scores(m, method, sname, kv)
                t0 = time.perf_counter()
                lay = m.layout
                tensors = compact_cache(method.keep(scores, ratio, lay.n_layers, lay.n_kv_heads, m.n_tokens), kv)
            self.seconds["compact"] = time.perf_counter() - t0
            self.builds += 1
            return self.store.add_artifact(pid, name, tensors_to_chunks(tensors))  # one tensor on the host at a time

    def ensure_scores(self, manifest: Manifest, method: CompressionMethod) -> Manifest:
        """The prefix's manifest listing ``method``'s scores artifact (computed now if missing; unchanged for a
        method that needs no scores). Used at prefill: later caches at any ratio skip the scoring pass."""
        name = method.scores_name()
        if name is None or manifest.artifact(name) is not None:
            return manifest
        m = self.store.manifest(manifest.prefix_id)
        if m.artifact(name) is not None:
            return m
        source = PrefixSource(self.store, m, self.lm.device)
        kv = [source.layer_kv(layer) for layer in range(m.layout.n_layers)]
        return self._scores(m, method, name, kv, at_prefill=True)[0]

    def _scores(self, m: Manifest, method: CompressionMethod, name: str,
                kv: list[tuple[torch.Tensor, torch.Tensor]], *,
                at_prefill: bool = False) -> tuple[Manifest, torch.Tensor]:
        """The stored scores, computed and stored first when missing (single flight too)."""
        with self._flights.hold((m.prefix_id, name)):
            m = self.store.manifest(m.prefix_id)
            if m.artifact(name) is not None:
                return m, bytes_to_tensors(self.store.artifact(m.prefix_id, name))[SCORES_KEY]
            ids = self._token_ids(m, kv)
            t0 = time.perf_counter()
            shown = PrefillProgress(enabled=self.progress)
            if not at_prefill:  # a generation waits on it: say why, in a line that stays
                shown.note(f"scoring prefix {m.prefix_id} for {method.name}")
            with shown.scoring(method.name):
                scores = method.score(self.lm, ids, kv).float().cpu()
            self.seconds["score"] = time.perf_counter() - t0
            self.scorings += 1
            m = self.store.add_artifact(m.prefix_id, name, tensors_to_chunks({SCORES_KEY: scores}))  # no copy
            return m, scores

    def _token_ids(self, m: Manifest, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        if m.artifact(TOKENS_ARTIFACT) is None:
            raise InvalidInput(f"prefix {m.prefix_id} stores no token ids (prefilled before compression existed): "
                               "prefill its document again to add them")
        return tokens_from_bytes(self.store.artifact(m.prefix_id, TOKENS_ARTIFACT))


def tokens_to_bytes(ids: list[int]) -> bytes:
    """The ``tokens`` artifact of a prefix: its token ids (int32)."""
    return tensors_to_bytes({"ids": torch.tensor(ids, dtype=torch.int32)})


def tokens_from_bytes(data: bytes | bytearray) -> list[int]:
    """Inverse of ``tokens_to_bytes``."""
    return [int(i) for i in bytes_to_tensors(data)["ids"].tolist()]
