"""A bounded, reusable pool of pinned host buffers that prefills stage device layers in (``PrefixWriter``).

A fresh pinned buffer of 512 MiB (one 128k-token layer of Llama-3.1-8B) took ~0.3 s on an H100 host, a
writer's 5 of them 1.6 s; torch keeps freed pinned blocks cached for the next allocation of their
power-of-two size, but never gives them back, however many concurrent prefills made them. The pool
keeps released buffers for the next lease instead, and never holds more than its bound (in use and
kept). When the buffers in use already fill it, a lease does not wait: ``lease`` hands out a pageable
buffer instead (``outside``), and a writer keeps those for its next layers. A wait could deadlock (a
writer holds its leases until its own writes drain, so two writers waiting for each other's buffers
would both stall) and would stall the GPU behind another prefill's disk writes; pageable memory only
makes the copy slower (H100: 43 ms per 512 MiB into touched pageable memory, 10 ms into pinned, and
~0.5 s the first time a fresh pageable buffer is written).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a buffer is made: importing the store stays light
    import torch

log = logging.getLogger(__name__)

Allocate = Callable[[int], "torch.Tensor"]
"""Makes a uint8 host buffer of exactly that many bytes."""


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (ordinary memory where CUDA is unavailable)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def pageable_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of ordinary (pageable) host memory."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def size_class(nbytes: int) -> int:
    """The bytes a pooled buffer for ``nbytes`` holds: the next power of two, what torch's pinned allocator
    takes for it anyway (so the bound counts the memory really pinned, and nearby sizes share buffers)."""
    return 1 << max(0, nbytes - 1).bit_length()


@dataclass(frozen=True)
class PoolStats:
    """What a pool holds and has done."""

    bound_bytes: int
    in_use_bytes: int
    """Pooled buffers leased out now."""
    free_bytes: int
    """Pooled buffers kept for reuse."""
    allocations: int
    """Pooled buffers allocated."""
    reuses: int
    """Leases served by a kept buffer."""
    fallbacks: int
    """Buffers made outside the pool (``outside``: the bound was full, or pinning failed)."""


class StagingLease:
    """One leased host buffer (``buffer``: uint8, at least the bytes asked for); ``release`` hands it back."""

    def __init__(self, pool: PinnedPool, buffer: torch.Tensor, nbytes: int, *, pooled: bool):
        self.buffer, self.nbytes, self.pooled = buffer, nbytes, pooled
        self._pool: PinnedPool | None = pool

    def view(self, shape: Sequence[int]) -> torch.Tensor:
        """The buffer's first bytes as a uint8 tensor of ``shape`` (at most the bytes leased)."""
        n = math.prod(shape)
        if n > self.nbytes:
            raise ValueError(f"a view of {n} bytes does not fit a lease of {self.nbytes}")
        return self.buffer[:n].view(*shape)

    @property
    def released(self) -> bool:
        """Whether the buffer went back (the lease may no longer be used)."""
        return self._pool is None

    def release(self) -> None:
        """Hand the buffer back (once; later calls do nothing). Nothing may read or write it afterwards."""
        pool = self._pool
        if pool is not None:
            pool._give_back(self)


class PinnedPool:
    """Pinned host buffers leased out and kept for reuse, at most ``bound_bytes`` of them (in use and kept);
    thread safe. ``allocate`` makes a pooled buffer (``pinned_buffer``), ``fallback`` one outside the pool
    (``pageable_buffer``): each makes a uint8 tensor of exactly the bytes asked."""

    def __init__(self, bound_bytes: int, *, allocate: Allocate | None = None, fallback: Allocate | None = None):
        if bound_bytes < 0:
            raise ValueError(f"bound_bytes must be >= 0, got {bound_bytes}")
        self.bound_bytes = bound_bytes
        self._allocate = allocate or pinned_buffer
        self._fallback = fallback or pageable_buffer
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._allocations = self._reuses = self._fallbacks = 0

    def lease(self, nbytes: int) -> StagingLease:
        """A buffer of at least ``nbytes``: a pooled one (``try_lease``), else one outside the pool."""
        return self.try_lease(nbytes) or self.outside(nbytes)

    def try_lease(self, nbytes: int) -> StagingLease | None:
        """A pooled buffer of at least ``nbytes``: a kept one (the smallest that fits), else a new one while the
        bound has room (kept buffers too small are freed for it); None when the buffers in use leave none."""
        if nbytes <= 0:
            raise ValueError(f"a lease needs at least one byte, got {nbytes}")
        cap = min(size_class(nbytes), max(nbytes, self.bound_bytes))
        with self._lock:
            buf = self._take_free(nbytes)
            if buf is not None:
                self._reuses += 1
                self._in_use += buf.numel()
                return StagingLease(self, buf, nbytes, pooled=True)
            dropped = self._make_room(cap)
            if dropped is None:
                return None
            self._in_use += cap  # reserved while it is allocated, outside the lock (that takes long)
        dropped.clear()  # the kept buffers that made room are freed here, outside the lock too
        buf = self._new_pooled(cap)
        return None if buf is None else StagingLease(self, buf, nbytes, pooled=True)

    def outside(self, nbytes: int) -> StagingLease:
        """A buffer of ``nbytes`` outside the pool (``fallback``'s), freed once released and unreferenced."""
        with self._lock:
            self._fallbacks += 1
        return StagingLease(self, self._fallback(nbytes), nbytes, pooled=False)

    def _take_free(self, nbytes: int) -> torch.Tensor | None:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if not fits:
            return None
        return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))

    def _make_room(self, cap: int) -> list[torch.Tensor] | None:
        """Take kept buffers out (oldest first) until ``cap`` more bytes fit the bound, and hand them back for
        freeing; None (nothing taken) when the buffers in use leave no room."""
        if self._in_use + cap > self.bound_bytes:
            return None
        dropped = []
        while self._in_use + sum(b.numel() for b in self._free) + cap > self.bound_bytes:
            dropped.append(self._free.pop(0))
        return dropped

    def _new_pooled(self, cap: int) -> torch.Tensor | None:
        """A new pooled buffer of ``cap`` bytes (already counted in use), or None (uncounted) when pinning fails."""
        try:
            buf = self._allocate(cap)
        except RuntimeError as e:  # pinned memory exhausted: the lease falls back, the prefill goes on
            log.warning("a pinned staging buffer of %d bytes failed (%s): using pageable memory", cap, e)
            with self._lock:
                self._in_use -= cap
            return None
        with self._lock:
            self._allocations += 1
        return buf

    def _give_back(self, lease: StagingLease) -> None:
        with self._lock:  # checked and marked at once: a lease released twice, even racing, goes back once
            if lease._pool is None:
                return
            lease._pool = None
            if lease.pooled:
                self._in_use -= lease.buffer.numel()
                self._free.append(lease.buffer)
        # a buffer outside the pool is dropped: freed with its last reference

    def stats(self) -> PoolStats:
        """What the pool holds now and how its leases were served."""
        with self._lock:
            return PoolStats(bound_bytes=self.bound_bytes, in_use_bytes=self._in_use,
                             free_bytes=sum(b.numel() for b in self._free), allocations=self._allocations,
                             reuses=self._reuses, fallbacks=self._fallbacks)

    def clear(self) -> None:
        """Free every kept buffer (leased ones return as usual)."""
        with self._lock:
            self._free.clear()
