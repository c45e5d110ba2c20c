"""Device memory a generation holds: the bytes of the tensors its own state keeps on its compute device.

Counted by walking the generation's state objects (its own K/V, its page caches, its method's state) down
to their tensors, each storage once: generations run concurrently, so a ``torch.cuda.memory_allocated``
delta would mix them up. On the CPU the same walk counts the same state's CPU tensors.

Not in a generation's total: state several generations share, i.e. objects whose
``shared_across_generations`` is true (Quest's page bounds and Top-K's key index of a prefix,
``methods/shared_state.py``: reported apart, as ``shared``);
the model's weights and feature maps (any ``nn.Module``); the worker's host tier (a CPU generation's
``HostPageView`` of it too) and summary cache, and
host staging buffers (host memory); the read counters' per-step scalars (``ReadCounter``); the static
buffers of a whole-step CUDA graph (the engine's, shared by a group of generations) and the memory pools
of captured graphs.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

import torch
from torch import nn

from workers.methods.reads import ReadCounter
from workers.methods.source import PrefixSource
from workers.offload.host_tier import HostTier
from workers.offload.host_view import HostPageView
from workers.offload.memory import HostBuffer
from workers.offload.stats import OffloadStats
from workers.offload.summaries import SummaryCache
from workers.own_kv import OwnKV

NOT_DEVICE_STATE = (nn.Module, HostTier, HostPageView, HostBuffer, SummaryCache, ReadCounter, OffloadStats)
"""Not walked: weights (shared); host-side state (the tiers are the worker's, a CPU generation's view of its
prefix in the host tier is the tier's memory, staging is host memory); read
counters (bookkeeping that grows with the steps: a walk through it would cost a visit per layer and step)."""
OURS = ("workers.",)
"""Modules whose objects are walked into (other objects are opaque: a store, a thread pool, a CUDA graph)."""
SHARED_FLAG = "shared_across_generations"
"""An object with this attribute true is shared by the generations over a prefix (counted apart)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceBytes:
    """Bytes of device memory one generation holds, by part (each storage counted once, in the first part)."""

    own_kv: int = 0
    """The K/V buffer of its own tokens (query and generated; ``workers.own_kv``)."""
    page_cache: int = 0
    """Its GPU page caches (the page fetcher's pools and maps, the device-planned cache's pools and tables)."""
    method: int = 0
    """Its method's state: resident prefix K/V (``full``, a compact cache, a query-time cache's layers),
    summaries and indexes it holds, selection buffers."""
    shared: int = 0
    """State it uses that other generations over the prefix share (not in ``total``)."""

    @property
    def total(self) -> int:
        """What the generation itself holds (shared state excluded)."""
        return self.own_kv + self.page_cache + self.method

    def to_extra(self) -> dict[str, float]:
        """The ``GenerationStats.extra`` counters: ``device_bytes`` and one ``device_bytes_<part>`` each."""
        parts = {f"device_bytes_{f.name}": float(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"device_bytes": float(self.total), **parts}


def _children(obj: object) -> Iterable[object]:
    """The values ``obj`` holds (a copy: another thread may be changing a shared object)."""
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not hasattr(obj, "__dict__"):  # slotted
        return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    return list(getattr(obj, "__dict__", {}).values())


def _walked(obj: object) -> bool:
    if isinstance(obj, (dict, list, tuple, set, frozenset, deque)):
        return True
    return type(obj).__module__.startswith(OURS) and not isinstance(obj, NOT_DEVICE_STATE)


class _Walk:
    """Tensors reachable from roots on one device, each storage counted once over every part."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seen: set[int] = set()
        self.storages: set[tuple[str, int]] = set()

    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self.device.type and (self.device.index is None or d.index == self.device.index)

    def shared_objects(self, roots: Iterable[object]) -> list[object]:
        """The shared objects reachable from ``roots`` (nothing is counted)."""
        found: list[object] = []
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in seen or not _walked(obj):
                continue
            seen.add(id(obj))
            if getattr(obj, SHARED_FLAG, False) is True:
                found.append(obj)
            else:
                stack.extend(_children(obj))
        return found

    def bytes(self, roots: Iterable[object]) -> int:
        """Bytes of the storages reachable from ``roots`` not counted by an earlier call."""
        total = 0
        stack = list(roots)
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                if not self._on_device(obj):
                    continue
                s = obj.untyped_storage()
                key = (str(obj.device), s.data_ptr())
                if s.nbytes() and key not in self.storages:
                    self.storages.add(key)
                    total += s.nbytes()
                continue
            if id(obj) in self.seen or not _walked(obj):
                continue
            self.seen.add(id(obj))
            stack.extend(_children(obj))
        return total


def device_bytes(*, own: object, page_cache: Iterable[object], method: object, device: torch.device) -> DeviceBytes:
    """What a generation holds on ``device``: ``own`` (its ``OwnKV``), ``page_cache`` (its page fetcher and
    device-planned cache, None entries skipped), ``method`` (its ``PrefixAttention``)."""
    w = _Walk(device)
    shared = w.bytes(w.shared_objects([method]))  # first: the method's own count then leaves them out
    own_b = w.bytes([own])
    cache_b = w.bytes([c for c in page_cache if c is not None])
    return DeviceBytes(own_kv=own_b, page_cache=cache_b, method=w.bytes([method]), shared=shared)


class DeviceMeter:
    """The peak of what a generation holds, over samples taken when its state grows most: at open, when its
    query is in (before a query-time cache drops the whole layers it read) and at the end."""

    def __init__(self, *, own: OwnKV, source: PrefixSource, method: object, device: torch.device):
        self._own, self._source, self._method, self._device = own, source, method, device
        self.peak = DeviceBytes()
        self.last = DeviceBytes()

    def sample(self) -> None:
        """Measure now (a walk of the generation's state: call between its steps)."""
        src = self._source
        self.last = device_bytes(own=self._own, page_cache=(src.fetcher, src.device_cache), method=self._method,
                                 device=self._device)
        if self.last.total > self.peak.total:
            self.peak = self.last
        if self.last.shared > self.peak.shared:  # reported apart from the total: its own peak (streamed-in bounds
            self.peak = dataclasses.replace(self.peak, shared=self.last.shared)  # arrive after the open)

    def to_extra(self) -> dict[str, float]:
        """The peak as ``DeviceBytes.to_extra`` (parts at the peak), and ``device_bytes_end``: held at the last
        sample."""
        return {**self.peak.to_extra(), "device_bytes_end": float(self.last.total)}
