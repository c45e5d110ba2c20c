"""Host-memory LRU of the small per-prefix artifacts a generation reads when it opens a prefix.

Opening a prefix reads its summaries (Quest page bounds, Double-P clusters, the φ cache) and its page
CRC table from the metadata store, checks their blake2b digests and parses them: per query, the same
work again for a hot prefix. ``SummaryCache`` (one per worker, thread-safe) keeps them parsed, exact
LRU under a byte budget (``OffloadConfig.summary_cache_bytes``). Entries are keyed by (prefix id,
artifact name, the digest the prefix's manifest records), so an entry can only ever serve the bytes
it was checked against: a prefix deleted and written again with other bytes misses. ``drop`` frees a
deleted prefix's entries at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from store.artifacts import bytes_to_tensors
from store.kvstore import PAGE_CRC_ARTIFACT, KVStore, read_only_u32
from store.manifest import Manifest

T = TypeVar("T")


class SummaryCache:
    """Parsed artifacts of recently used prefixes, at most ``max_bytes`` (0: caches nothing)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[str, str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def tensors(self, store: KVStore, manifest: Manifest, name: str) -> dict[str, torch.Tensor]:
        """Artifact ``name`` of the prefix as CPU tensors (shared by callers: do not modify them)."""
        return self._get(store, manifest, name, bytes_to_tensors, _tensor_bytes)

    def page_crcs(self, store: KVStore, manifest: Manifest) -> np.ndarray:
        """The prefix's keyed page CRCs ``[layers, kv_heads, pages]`` (read-only)."""
        lay = manifest.layout
        shape = (lay.n_layers, lay.n_kv_heads, lay.n_pages(manifest.n_tokens))
        return self._get(store, manifest, PAGE_CRC_ARTIFACT,
                         lambda data: read_only_u32(data, shape), lambda a: a.nbytes)

    def cached_tensors(self, manifest: Manifest, name: str) -> dict[str, torch.Tensor] | None:
        """Artifact ``name``'s tensors when the cache holds them (counted as a hit), else None (not counted: the
        caller reads them, then ``add_tensors``)."""
        return self._hit(self._key(manifest, name))

    def add_tensors(self, manifest: Manifest, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep artifact ``name``'s tensors, read and checked by the caller (a miss)."""
        with self._lock:
            self.misses += 1
        self._put(self._key(manifest, name), tensors, _tensor_bytes(tensors))

    def drop(self, prefix_id: str) -> int:
        """Forget every entry of ``prefix_id`` (e.g. it was deleted); returns the bytes freed."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == prefix_id]
            freed = sum(self._entries.pop(k)[1] for k in gone)
            self.used_bytes -= freed
            return freed

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(manifest: Manifest, name: str) -> tuple[str, str, str]:
        info = manifest.artifact(name)
        return manifest.prefix_id, name, info.blake2b if info is not None else ""

    def _get(self, store: KVStore, manifest: Manifest, name: str, parse: Callable[[bytearray], T],
             size_of: Callable[[T], int]) -> T:
        key = self._key(manifest, name)
        if (hit := self._hit(key)) is not None:
            return hit
        with self._lock:
            self.misses += 1
        value = parse(store.artifact(manifest.prefix_id, name))  # digest-checked (raises when absent)
        self._put(key, value, int(size_of(value)))
        return value

    def _hit(self, key: tuple[str, str, str]) -> Any | None:
        """The entry under ``key``, made the most recent and counted as a hit; None (not counted) when absent."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return hit[0]

    def _put(self, key: tuple[str, str, str], value: Any, size: int) -> None:
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            while self.used_bytes + size > self.max_bytes:
                _, (_, old) = self._entries.popitem(last=False)
                self.used_bytes -= old
            self._entries[key] = (value, size)
            self.used_bytes += size


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
