"""Costly prefill summaries, built after the prefix is committed.

Every prefill computes the summaries the sparse methods read. Most are cheap: Quest's bounds, MoBA's block means and
Top-K's key index take 0.14 s at 128k on an H200. Two are not: Double-P's k-means and the φ cache take 3.5 s there,
and with them the prefill runs at 0.68x the forward pass instead of 0.96x. Those summarizers are marked ``late``,
and so is ``topk+vi``'s value index (as many bytes as the key index, for one method). Under the ``background``
policy (the default on a CUDA device) a prefill commits the prefix without them, so Quest, Top-K and MoBA serve it
at once. A background thread then builds them from the stored pages and adds them to the prefix, one artifact at a
time (``KVStore.add_artifact``: nothing is visible until an artifact is whole). Under ``on_use`` (the default
elsewhere) nothing is built until a generation needs it: on the CPU a background build would take the cores the
next forward pass needs, and Double-P's k-means alone costs more than the forward pass (about 1.2 s of a 4k
layer's prefill on one thread), so a prefix that is only ever asked through Quest or Top-K never pays for it.
Either way, a generation whose method needs a late summary that is missing waits for the build in flight, or
runs it. Within a worker there is one build per (prefix, summary); across workers the store keeps the first
committed copy. ``inline`` computes everything in the prefill, as before.

A late summary is the same bytes as the inline one: the same summarizer over the same K/V, read back from the
store (the tests compare the artifacts' digests).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Literal, get_args

import torch

from store.kvstore import KVStore
from store.layer_artifact import layer_artifact_chunks
from store.manifest import Manifest
from workers.methods.base import Summarizer
from workers.methods.registry import build_summarizer, prefill_summarizers
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.offload import PageFetcher
from workers.progress import PrefillProgress
from workers.pull_ahead import pull_ahead
from workers.single_flight import SingleFlight

log = logging.getLogger(__name__)

LatePolicy = Literal["auto", "inline", "background", "on_use"]
"""When the ``late`` summaries are built: ``inline`` in the prefill; ``background`` right after its commit;
``on_use`` when a generation first needs one; ``auto``: ``background`` on a CUDA device, else ``on_use``."""
LATE_POLICIES: tuple[str, ...] = get_args(LatePolicy)

LATE_WRITE_AHEAD_CHUNKS = 8
"""Chunks of the first late artifact (about two layers' tensors) produced ahead of its writer."""


class LateSummaries:
    """One worker's builder of the late summaries of its prefixes (thread-safe)."""

    def __init__(self, store: KVStore, lm: LoadedModel, *, policy: LatePolicy = "auto", progress: bool = False,
                 open_fetcher: Callable[[Manifest], PageFetcher | None] | None = None):
        if policy not in LATE_POLICIES:
            raise ValueError(f"late summaries policy must be one of {LATE_POLICIES}, got {policy!r}")
        self.store, self.lm, self.progress = store, lm, progress
        self._open_fetcher = open_fetcher
        """The worker's tiered reader of a prefix's pages (its pinned host tier: the build warms it for the
        prefix's first generations); None: each layer read from its page file."""
        self.policy: LatePolicy = policy if policy != "auto" else (
            "background" if lm.device.type == "cuda" else "on_use")
        self._flights = SingleFlight()
        self._lock = threading.Lock()
        """Guards the thread, its jobs and the counters (prefills and generations call in from many threads)."""
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future[Manifest]] = []
        self.builds = 0
        """Late summaries this worker built (not counting those found committed)."""
        self.seconds: dict[str, float] = {}
        """Wall time of the last build of each set of summaries built together (by their names, comma-joined)."""
        self.timed = False
        """Also time each summarizer and the wait for each layer's K/V (``parts``), the device synchronized after
        each: a profile for benchmarks, which stalls the device's other work."""
        self.parts: dict[str, float] = {}
        """Seconds of the timed builds by part (a summarizer's name, or ``read`` for the wait on a layer's K/V)."""

    def deferred(self) -> tuple[type[Summarizer], ...]:
        """The summarizers a prefill leaves out (none under ``inline``)."""
        if self.policy == "inline":
            return ()
        return tuple(s for s in prefill_summarizers() if s.late)

    def missing(self, manifest: Manifest, needed: Iterable[type[Summarizer]] | None = None
                ) -> list[type[Summarizer]]:
        """The late summarizers among ``needed`` (default: all) that the prefix does not store yet."""
        kinds = prefill_summarizers() if needed is None else needed
        return [s for s in kinds if s.late and manifest.artifact(s.name) is None]

    def after_commit(self, manifest: Manifest) -> None:
        """Start building the prefix's missing late summaries in the background (``background`` policy only)."""
        if self.policy != "background" or not self.missing(manifest):
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="late-summaries")
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(self._pool.submit(self._background, manifest))

    def _background(self, manifest: Manifest) -> Manifest:
        try:
            return self.ensure(manifest, shown=False)  # no bar from a thread the caller does not wait on
        except Exception:  # a generation that needs it builds it again (and sees the error)
            log.warning("late summaries of prefix %s failed", manifest.prefix_id, exc_info=True)
            raise

    def ensure(self, manifest: Manifest, needed: Iterable[type[Summarizer]] | None = None, *,
               shown: bool = True) -> Manifest:
        """The prefix's manifest listing every late summary among ``needed`` (default: all), built now if missing
        (with a progress bar, when the worker shows them and ``shown``)."""
        kinds = sorted(self.missing(manifest, needed), key=lambda s: s.name)  # one lock order for every caller
        if not kinds:
            return manifest
        pid = manifest.prefix_id
        with contextlib.ExitStack() as held:
            for kind in kinds:
                held.enter_context(self._flights.hold((pid, kind.name)))
            m = self.store.manifest(pid)
            todo = [k for k in kinds if m.artifact(k.name) is None]  # the rest were built while we waited
            if todo:
                m = self._build(m, todo, shown=shown)
            return m

    def _build(self, m: Manifest, kinds: list[type[Summarizer]], *, shown: bool) -> Manifest:
        """Build ``kinds`` in one pass over the layers (each layer's K/V read once): the first one's layers go
        to its artifact as they come, the others' are kept on the host (they are small: the φ cache is under
        1 MB a layer) and stored after it."""
        pid, n_layers = m.prefix_id, m.layout.n_layers
        t0 = time.perf_counter()
        summarizers = [build_summarizer(kind, self.lm.phi_map) for kind in kinds]
        kept: list[list[dict[str, torch.Tensor]]] = [[] for _ in kinds[1:]]
        pulled = [0]  # layers of the first summary pulled into its artifact (0: another worker's was committed)
        names = ", ".join(k.name for k in kinds)
        with self.store.lease(pid), PrefillProgress(enabled=self.progress and shown).summarizing(names):
            source = PrefixSource(self.store, m, self.lm.device)
            source.fetcher = self._open_fetcher(m) if self._open_fetcher is not None else None
            try:
                first = _first_and_kept(summarizers, source, n_layers, kept, pulled,
                                        _PartClock(self.parts, self.lm.device, self._lock) if self.timed else None)
                # The next layer is summarized (and copied to the host) while this one is hashed and written.
                chunks = pull_ahead(layer_artifact_chunks(kinds[0].name, n_layers, first), LATE_WRITE_AHEAD_CHUNKS,
                                    name="late-summaries-ahead")
                try:
                    m = self.store.add_artifact(pid, kinds[0].name, chunks)
                finally:
                    chunks.close()  # on a refusal mid-way, stop the producer now (not when the traceback goes)
                # Another worker may have committed the first one meanwhile: then nothing was pulled or kept, and
                # the others still missing get a pass of their own below.
                unread = [k for k, layers in zip(kinds[1:], kept, strict=True) if len(layers) < n_layers]
                for kind, layers in zip(kinds[1:], kept, strict=True):
                    if len(layers) == n_layers:
                        m = self.store.add_artifact(pid, kind.name, layer_artifact_chunks(kind.name, n_layers, layers))
            finally:
                if source.fetcher is not None:
                    source.fetcher.close()
        with self._lock:
            self.seconds[names] = time.perf_counter() - t0
            self.builds += (pulled[0] == n_layers) + len(kinds) - 1 - len(unread)
        if still := [k for k in unread if m.artifact(k.name) is None]:
            m = self._build(m, still, shown=shown)
        return m

    def wait(self) -> None:
        """Wait for the background builds started so far (their errors are logged, not raised)."""
        with self._lock:
            jobs = list(self._jobs)
        wait(jobs)
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]

    def close(self) -> None:
        """Wait for the background builds, then stop the thread."""
        self.wait()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _PartClock:
    """Adds the seconds of each timed part of a build to ``parts`` (the device synchronized at each boundary)."""

    def __init__(self, parts: dict[str, float], device: torch.device, lock: threading.Lock):
        self.parts, self.device, self.lock = parts, device, lock

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as ``name``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self.lock:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0


def _first_and_kept(summarizers: list[Summarizer], source: PrefixSource, n_layers: int,
                    kept: list[list[dict[str, torch.Tensor]]], pulled: list[int],
                    clock: _PartClock | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Each layer's summary tensors of the first summarizer, one layer's K/V read at a time, the next one's read
    started meanwhile (``_ReadAhead``); the other summarizers' go to ``kept`` on the host; ``pulled[0]`` counts the
    layers yielded; ``clock`` times the parts."""
    def part(name: str) -> contextlib.AbstractContextManager[None]:
        return clock.part(name) if clock is not None else contextlib.nullcontext()

    with _ReadAhead(source, n_layers) as ahead:
        for layer in range(n_layers):
            with part("read"):
                k, v = ahead.layer(layer)
            for s, out in zip(summarizers[1:], kept, strict=True):
                with part(s.name):
                    out.append({name: t.cpu() for name, t in s.summarize(layer, k, v).items()})
            with part(summarizers[0].name):
                first = summarizers[0].summarize(layer, k, v)
            yield first
            pulled[0] += 1


class _ReadAhead:
    """Each layer's K/V on the device, the next layer's read started on a thread while this one is summarized.
    With a fetcher with a host tier, the next layer is loaded into the tier with large sequential reads
    (``PageFetcher.warm_host``) and ``whole_layer`` then copies from it (a layer the tier had no room for is
    fetched as before); without a fetcher, the next layer is read from its page file onto the host."""

    def __init__(self, source: PrefixSource, n_layers: int):
        self.source, self.n_layers = source, n_layers
        fetcher = source.fetcher
        self._warm = fetcher.warm_host if fetcher is not None and fetcher.host is not None else None
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future[object] | None = None

    def __enter__(self) -> _ReadAhead:
        if self._warm is not None or self.source.fetcher is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="late-read-ahead")
            self._next = self._start(0)
        return self

    def _start(self, layer: int) -> Future[object] | None:
        if self._pool is None or layer >= self.n_layers:
            return None
        if self._warm is not None:
            return self._pool.submit(self._warm, [layer])
        return self._pool.submit(self.source.host_layer_kv, layer)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K, V on the device (the layers in order); raises what its read raised."""
        if self._next is None:
            return self.source.whole_layer(layer)
        got = self._next.result()
        self._next = self._start(layer + 1)
        if self._warm is not None:
            return self.source.whole_layer(layer)
        assert isinstance(got, tuple)
        host_k, host_v = got
        return host_k.to(self.source.device), host_v.to(self.source.device)

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # a read in flight finishes (pages it loaded stay in the tier)
