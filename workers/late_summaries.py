"""Costly prefill summaries, built after the prefix is committed.

Every prefill computes the summaries the sparse methods read. Most are cheap: Quest's bounds, MoBA's block means
and Top-K's key index take 0.14 s at 128k on an H200. Two are not: Double-P's k-means and the φ cache take 3.5 s
there, and with them the prefill runs at 0.68x the forward pass instead of 0.96x. Those summarizers are marked
``late``. Under the ``background`` policy (the default on a CUDA device) a prefill commits the prefix without
them, so Quest, Top-K and MoBA serve it at once. A background thread then builds them from the stored pages and
adds them to the prefix, one artifact at a time (``KVStore.add_artifact``: nothing is visible until an artifact
is whole). Under ``on_use`` nothing is built until a generation needs it. Either way, a generation whose method
needs a late summary that is missing waits for the build in flight, or runs it. Within a worker there is one build
per (prefix, summary); across workers the store keeps the first committed copy. ``inline`` computes everything
in the prefill, as before, and is the default elsewhere: on the CPU the forward pass dominates, and a background
build would take the same cores.

A late summary is the same bytes as the inline one: the same summarizer over the same K/V, read back from the
store (the tests compare the artifacts' digests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Literal, get_args

from store.kvstore import KVStore
from store.layer_artifact import layer_artifact_chunks
from store.manifest import Manifest
from workers.methods.base import Summarizer
from workers.methods.registry import build_summarizer, prefill_summarizers
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.progress import PrefillProgress
from workers.single_flight import SingleFlight

log = logging.getLogger(__name__)

LatePolicy = Literal["auto", "inline", "background", "on_use"]
"""When the ``late`` summaries are built: ``inline`` in the prefill; ``background`` right after its commit;
``on_use`` when a generation first needs one; ``auto``: ``background`` on a CUDA device, else ``inline``."""
LATE_POLICIES: tuple[str, ...] = get_args(LatePolicy)


class LateSummaries:
    """One worker's builder of the late summaries of its prefixes (thread-safe)."""

    def __init__(self, store: KVStore, lm: LoadedModel, *, policy: LatePolicy = "auto", progress: bool = False):
        if policy not in LATE_POLICIES:
            raise ValueError(f"late summaries policy must be one of {LATE_POLICIES}, got {policy!r}")
        self.store, self.lm, self.progress = store, lm, progress
        self.policy: LatePolicy = policy if policy != "auto" else (
            "background" if lm.device.type == "cuda" else "inline")
        self._flights = SingleFlight()
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future[Manifest]] = []
        self.builds = 0
        """Late summaries this worker built (not counting those found committed)."""
        self.seconds: dict[str, float] = {}
        """Wall time of each summary's last build, by artifact name."""

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
        for kind in self.missing(manifest, needed):
            manifest = self._build(manifest, kind, shown=shown)
        return manifest

    def _build(self, manifest: Manifest, kind: type[Summarizer], *, shown: bool) -> Manifest:
        pid = manifest.prefix_id
        with self._flights.hold((pid, kind.name)):
            m = self.store.manifest(pid)
            if m.artifact(kind.name) is not None:  # built while we waited (here, or by another worker)
                return m
            t0 = time.perf_counter()
            summarizer = build_summarizer(kind, self.lm.phi_map)
            with self.store.lease(pid), PrefillProgress(enabled=self.progress and shown).summarizing(kind.name):
                source = PrefixSource(self.store, m, self.lm.device)
                layers = _summaries(summarizer, source, m.layout.n_layers)
                m = self.store.add_artifact(pid, kind.name, layer_artifact_chunks(kind.name, m.layout.n_layers,
                                                                                  layers))
            self.seconds[kind.name] = time.perf_counter() - t0
            self.builds += 1
            return m

    def wait(self) -> None:
        """Wait for the background builds started so far (their errors are logged, not raised)."""
        wait(self._jobs)
        self._jobs = [j for j in self._jobs if not j.done()]

    def close(self) -> None:
        """Wait for the background builds, then stop the thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _summaries(summarizer: Summarizer, source: PrefixSource, n_layers: int) -> Iterator[dict]:
    """Each layer's summary tensors, one layer's K/V read at a time."""
    for layer in range(n_layers):
        k, v = source.layer_kv(layer)
        yield summarizer.summarize(layer, k, v)
