"""Where a `Worker.prefill` with the store spends its time: wall seconds per phase on the prefill's own thread
(each phase synchronized with the device, so GPU work is charged to the phase that launched it), and busy
seconds per kind of background job. A diagnostic for `bench_prefill.py --phases`; wraps, never changes, the
product's functions."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from store import layer_artifact, writer
from workers import engine
from workers.methods.registry import prefill_summarizers


class PhaseClock:
    """Seconds per named phase, added from any thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, name: str, s: float) -> None:
        with self._lock:
            self.seconds[name] += s

    def timed(self, name: str, fn: Callable[..., Any], *, sync: bool) -> Callable[..., Any]:
        """``fn`` charging its time to ``name`` (the device synchronized before and after when ``sync``)."""
        def wrapped(*a: Any, **kw: Any) -> Any:
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if sync and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.add(name, time.perf_counter() - t0)
        return wrapped


@contextlib.contextmanager
def phases(device: torch.device) -> Iterator[PhaseClock]:
    """Wrap the prefill's phases and background jobs while the block runs."""
    clock = PhaseClock(device)
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, label: str, *, sync: bool) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, clock.timed(label, getattr(owner, name), sync=sync))

    real_kv = engine.prefill_kv

    def timed_kv(*a: Any, **kw: Any) -> Iterator[Any]:
        it = real_kv(*a, **kw)
        while True:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                clock.add("main: forward (next layer's K/V)", time.perf_counter() - t0)
            yield item

    saved.append((engine, "prefill_kv", real_kv))
    engine.prefill_kv = timed_kv  # type: ignore[assignment]
    patch(writer.PrefixWriter, "write_layer", "main: write_layer (pack, stage, queue; waits for old layers)", sync=True)
    patch(writer.PrefixWriter, "commit", "main: commit (pending writes, artifacts, manifest)", sync=False)
    patch(layer_artifact.LayerArtifact, "add", "main: summary artifact add (queue)", sync=True)
    patch(layer_artifact.LayerArtifact, "close", "main: summary artifacts close", sync=False)
    patch(writer, "write_bytes_durably", "jobs: page file write", sync=False)
    patch(writer.PrefixWriter, "_page_crcs", "jobs: page CRCs", sync=False)
    patch(layer_artifact.LayerArtifact, "_write", "jobs: summary layer write", sync=False)
    for s in prefill_summarizers():
        patch(s, "summarize", f"main: summarize {s.__name__}", sync=True)
    try:
        yield clock
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
