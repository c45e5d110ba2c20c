"""The worker: prefill a document into the store once, then generate answers from it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

from store.capacity import LeaseHandle
from store.errors import ContextTooLong, InvalidInput, LockTimeout, ModelMismatch
from store.kvstore import KVStore
from store.layer_artifact import LayerArtifact
from store.manifest import Manifest
from store.prefix_key import PrefixKey, tenant_salt, token_hash
from workers.attention import PrefixAttention
from workers.compression import TOKENS_ARTIFACT, Compressions, tokens_to_bytes
from workers.decode_batch import DecodeEngine, EngineConfig, Generation
from workers.device_bytes import DeviceMeter
from workers.late_summaries import LatePolicy, LateSummaries
from workers.methods.base import ReportsReads, UsesCudaGraphs
from workers.methods.compressed import CompressionMethod
from workers.methods.lookahead import LookaheadModel
from workers.methods.registry import build_summarizers, get_method, prefill_summarizers
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.offload import HostTier, OffloadConfig, PageFetcher
from workers.offload.fast_path import FastOpen
from workers.offload.summaries import SummaryCache
from workers.own_kv import FIRST_STEPS, OwnKV
from workers.prefill import DEFAULT_CHUNK, prefill_kv
from workers.prefill_summaries import SummaryLane
from workers.progress import PrefillProgress
from workers.ratplus import has_decaying_memory
from workers.requests import DecodeConfig, GenerationStats, SamplingParams, compress_names
from workers.sampling import Sampler
from workers.textstream import TextStream

DEFAULT_TENANT = "default"
DEFAULT_OFFLOAD = OffloadConfig()


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What a prefill produced: the prefix id, its size, and whether it was already stored."""

    prefix_id: str
    n_tokens: int
    cached: bool
    manifest: Manifest


def _close_fetch(source: PrefixSource) -> None:
    """Release a generation's fetch engines (the device cache and host view first: they hold host-tier slots;
    closing the fetcher stops its background warm-up)."""
    if source.device_cache is not None:
        source.device_cache.close()
    if source.host_view is not None:
        source.host_view.close()
    if source.fetcher is not None:
        source.fetcher.close()


class Worker:
    """Prefills documents into a store and decodes queries over stored prefixes."""

    def __init__(self, store: KVStore, lm: LoadedModel, *, secret: str = "", chunk_size: int = DEFAULT_CHUNK,
                 progress: bool = True, offload: OffloadConfig | None = DEFAULT_OFFLOAD,
                 engine: EngineConfig | None = None, summaries_beside: bool = False,
                 late_summaries: LatePolicy = "auto"):
        self.store, self.lm, self.secret = store, lm, secret
        self.summaries_beside = summaries_beside
        """On a CUDA device, compute each layer's prefill summaries on a side stream beside the forward pass
        (``workers.prefill_summaries``); else (the default, faster in the last H200 measurement) inline, between
        layers."""
        self.engine = DecodeEngine(lm, engine)
        """Batches this worker's concurrent generations (its ``turn`` is set by a server's scheduler)."""
        self.chunk_size, self.progress = chunk_size, progress
        self.offload = offload
        """Tiered per-step page fetch for sparse methods (None: each layer read once and held)."""
        self._host: HostTier | None = None
        self._host_lock = threading.Lock()
        self.summaries = SummaryCache((offload or DEFAULT_OFFLOAD).summary_cache_bytes)
        """Parsed summaries and page-CRC tables of recently opened prefixes (host memory, LRU)."""
        self.compressions = Compressions(store, lm, progress=progress)
        """Builds compressed caches of stored prefixes on first use (single flight)."""
        self.late = LateSummaries(store, lm, policy=late_summaries, progress=progress, open_fetcher=self._fetcher)
        """Builds the costly (``late``) summaries after a prefill's commit, or on first use (``LatePolicy``)."""
        if lm.layout.page_size != store.config.page_size:
            raise ValueError("model layout and store disagree on page_size")

    def _fetcher(self, m: Manifest) -> PageFetcher | None:
        """A tiered page reader of prefix ``m`` over this worker's host tier (None without offload)."""
        if self.offload is None:
            return None
        return PageFetcher(self.store, m, self.lm.device, self.offload, self.host_tier(), summaries=self.summaries)

    def host_tier(self) -> HostTier | None:
        """The worker's pinned host tier, shared by its generations (allocated on first use)."""
        with self._host_lock:
            if self._host is None and self.offload is not None:
                self._host = HostTier.from_config(self.lm.layout, self.offload)
            return self._host

    # -- prefill ---------------------------------------------------------------------------
    def prefix_key(self, token_ids: list[int], tenant: str = DEFAULT_TENANT) -> PrefixKey:
        """The key (and so the id) a document's tokens get under this model and tenant."""
        return PrefixKey(
            model_fingerprint=self.lm.fingerprint,
            tenant_salt=tenant_salt(tenant, self.secret),
            token_hash=token_hash(token_ids),
            layout=self.lm.layout,
            summarizers=tuple((s.name, s.version) for s in prefill_summarizers()),
        )

    def tokenize_document(self, document: str) -> list[int]:
        """Token ids of a document (with the model's BOS); validates length."""
        if not isinstance(document, str) or not document.strip():
            raise InvalidInput("document is empty")
        ids = list(self.lm.tokenizer(document).input_ids)
        if len(ids) >= self.lm.max_context:
            raise ContextTooLong(f"document has {len(ids)} tokens; the model's context is {self.lm.max_context} "
                                 "(leave room for the query)")
        return ids

    def prefill(self, document: str, tenant: str = DEFAULT_TENANT, *, compress: Sequence[str] = ()) -> PrefillResult:
        """Store a document's KV and summaries unless an identical prefix exists (then no forward pass); then
        the scores of each ``compress`` method (``PREFILL_SCORERS``) unless stored, so that a generation with it
        at any ratio only builds its compact cache."""
        scorers = [self._scorer(name) for name in compress_names(tuple(compress))]  # refused before any work
        ids = self.tokenize_document(document)
        key = self.prefix_key(ids, tenant)
        pid = key.prefix_id
        if (m := self.store.find(pid)) is not None:
            m, cached = self._with_tokens(m, ids), True
        else:
            with self._prefill_lock(pid):  # single flight across processes and hosts sharing the metadata
                if (m := self.store.find(pid)) is not None:
                    cached = True
                else:
                    m, cached = self._write_prefix(key, ids, tenant), False
        self.late.after_commit(m)  # a cached prefix too: its build may have been cut short
        for method in scorers:  # outside the prefill lock: scoring has its own single flight
            m = self.compressions.ensure_scores(m, method)
        return PrefillResult(prefix_id=pid, n_tokens=m.n_tokens, cached=cached, manifest=m)

    def _scorer(self, name: str) -> CompressionMethod:
        """The compression method ``name``, able to score this model's prefixes (HybridKV: its head ranking)."""
        method = get_method(name, head_scores=self.lm.head_scores)
        if not isinstance(method, CompressionMethod) or method.scores_name() is None:  # PREFILL_SCORERS drifted
            raise InvalidInput(f"method {name!r} has no scores to compute at prefill")
        return method

    def _with_tokens(self, m: Manifest, ids: list[int]) -> Manifest:
        """A cached prefix stored before token ids were kept gets them now (compression repeats them)."""
        if m.artifact(TOKENS_ARTIFACT) is not None:
            return m
        return self.store.add_artifact(m.prefix_id, TOKENS_ARTIFACT, tokens_to_bytes(ids))

    @contextlib.contextmanager
    def _prefill_lock(self, prefix_id: str) -> Iterator[None]:
        """The prefix's single-flight lock; says so (with progress on) when another prefill of it holds it."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.store.prefill_lock(prefix_id, wait_s=0))
            except LockTimeout:
                PrefillProgress(enabled=self.progress).note(
                    f"waiting for another prefill of this document (prefix {prefix_id}) to finish")
                held.enter_context(self.store.prefill_lock(prefix_id))
            yield

    def _write_prefix(self, key: PrefixKey, ids: list[int], tenant: str) -> Manifest:
        summarizers = build_summarizers(self.lm.phi_map, skip=self.late.deferred())
        shown = PrefillProgress(enabled=self.progress, n_layers=self.lm.layout.n_layers)
        with self.store.write_prefix(key, model_name=self.lm.name, n_tokens=len(ids), tenant=tenant) as w, \
                contextlib.ExitStack() as held:
            # Each layer's summaries go to their artifact as they come, from a background thread per artifact:
            # device and host memory hold a couple of layers' of them, and no byte is written twice.
            outs = [(s, held.enter_context(LayerArtifact(w.open_artifact(s.name), self.lm.layout.n_layers)))
                    for s in summarizers]
            lane = held.enter_context(SummaryLane(outs, self.lm.device, beside=self.summaries_beside))
            for layer, k, v in shown.layers(prefill_kv(self.lm, ids, chunk_size=self.chunk_size,
                                                       progress=self.progress, desc=shown.forward_desc)):
                w.write_layer(layer, k, v)
                lane.add(layer, k, v)
            with shown.committing():  # pending page writes, fsyncs, artifacts and the metadata commit
                lane.close()
                for _, out in outs:
                    out.close()
                w.put_artifact(TOKENS_ARTIFACT, tokens_to_bytes(ids))
                return w.commit()

    def remove_prefix(self, prefix_id: str, *, unless_leased: bool = False) -> None:
        """Delete a stored prefix and forget its cached summaries (``PrefixInUse`` instead while a generation
        reads it, when ``unless_leased``)."""
        self.store.remove(prefix_id, unless_leased=unless_leased)
        self.summaries.drop(prefix_id)

    # -- generate --------------------------------------------------------------------------
    def open_prefix(self, prefix_id: str, tenant: str = DEFAULT_TENANT) -> Manifest:
        """The manifest of a prefix this tenant may decode with this model."""
        m = self.store.visible(prefix_id, tenant, secret=self.secret)
        if m.key.model_fingerprint != self.lm.fingerprint:
            raise ModelMismatch(f"prefix {prefix_id} was saved by model {m.model_name!r} "
                                f"(fingerprint {m.key.model_fingerprint}); this worker runs {self.lm.name!r}")
        return m

    def generate(self, prefix_id: str, query: str, params: SamplingParams | None = None, *, method: str = "full",
                 decode: DecodeConfig | None = None, tenant: str = DEFAULT_TENANT,
                 stats: GenerationStats | None = None, raw: bool = False) -> GenerationStream:
        """Stream the answer to ``query`` over a stored prefix, as text pieces.

        The query is wrapped in the model's query template unless ``raw``. The generation joins the
        worker's decode engine: concurrent generations advance together, one batched step at a time.
        """
        t0 = time.perf_counter()
        params = params or SamplingParams()
        m = self.open_prefix(prefix_id, tenant)
        if not isinstance(query, str) or not query.strip():
            raise InvalidInput("query is empty")
        text = query if raw else self.lm.prompt.format_query(query)
        q_ids = list(self.lm.tokenizer(text, add_special_tokens=False).input_ids)
        room = self.lm.max_context - m.n_tokens - len(q_ids)
        if room < 1:
            raise ContextTooLong(f"prefix ({m.n_tokens}) + query ({len(q_ids)}) tokens exceed the model's context "
                                 f"of {self.lm.max_context}")
        impl = get_method(method, self.lm.phi_map, self._lookahead(), self.lm.head_scores)
        decode = decode or DecodeConfig()
        m = self.late.ensure(m, impl.reads_summaries())  # a late summary it reads: built now if not yet
        source = PrefixSource(self.store, m, self.lm.device, summaries=self.summaries)
        source.stream_summaries = True  # the engine verifies them when the query is in (VerifiesSummaries)
        held = contextlib.ExitStack()
        # Leased before anything is read: eviction, and a delete that respects leases, keep away from here on.
        lease = held.enter_context(self.store.lease(m.prefix_id))
        held.callback(_close_fetch, source)  # runs first: the fetch engines go before the lease
        try:
            if isinstance(impl, CompressionMethod):  # its compact cache, built on first use (once per ratio)
                source.manifest = self.compressions.ensure(m, impl, impl.ratio_of(decode))
            if impl.fetches_pages and self.offload is not None:
                source.fetcher = PageFetcher(self.store, m, self.lm.device, self.offload, self.host_tier(),
                                             summaries=self.summaries)
                if impl.fast_open:
                    fast = FastOpen(source.fetcher, self.offload)  # warms the host tier (in the background)
                    source.device_cache, source.switch = fast.device_cache, fast.poll
                    source.host_view, source.view_switch = fast.host_view, fast.poll_view
            attn = impl.open(source, decode)
            if self.engine.config.cuda_graphs and isinstance(attn, UsesCudaGraphs):
                attn.use_cuda_graphs()
            gen = self._generation(attn, source, q_ids, params, min(room, params.max_new_tokens),
                                   stats if stats is not None else GenerationStats(), tenant, started=t0)
            gen.meter = DeviceMeter(own=gen.own, source=source, method=attn, device=self.lm.device)
            gen.meter.sample()
            gen.stats.extra["open_s"] = time.perf_counter() - t0  # summaries and setup, before any step
            # Joins the engine now, not at the consumer's first pull: it rides the next step whoever drives it
            # (a consumer pulling several streams in turn would otherwise add one generation per step).
            self.engine.start(gen)
        except BaseException:
            held.close()
            raise
        return GenerationStream(self.engine, gen, self._run(gen, source, lease), held)

    def _lookahead(self) -> LookaheadModel | None:
        """The model's trained lookahead parts (None: the model ships none)."""
        return LookaheadModel(self.lm.model, self.lm.lookahead) if self.lm.lookahead is not None else None

    def _generation(self, attn: PrefixAttention, source: PrefixSource, q_ids: list[int], params: SamplingParams,
                    max_new: int, stats: GenerationStats, tenant: str, started: float) -> Generation:
        lm, lay = self.lm, self.lm.layout
        own = OwnKV(lay, len(q_ids) + max_new, lm.device, lm.model.dtype, initial=len(q_ids) + FIRST_STEPS)
        if has_decaying_memory(lm.model.config):  # its first own token continues the prefix's memory state
            own.seed = source.last_token_kv().to(lm.model.dtype)
        stats.prompt_tokens, stats.finish_reason = len(q_ids), "length"
        text = TextStream(lm.tokenizer, params.stop or lm.prompt.stop)
        return Generation(prefix=attn, own=own, pending=list(q_ids), position=source.n_tokens,
                          sampler=Sampler(params, lm.device), text=text, eos_ids=lm.eos_ids, max_new=max_new,
                          stats=stats, tenant=tenant, started=started,
                          full_step_bytes=source.n_tokens * lay.token_kv_bytes() * lay.n_kv_heads * lay.n_layers)

    def _run(self, gen: Generation, source: PrefixSource, lease: LeaseHandle) -> Generator[str, None, None]:
        try:
            while (piece := self.engine.next_piece(gen)) is not None:
                lease.keepalive()
                yield piece
        finally:
            self.engine.close(gen)
        _finish_stats(gen, source)


class GenerationStream(Iterator[str]):
    """The text pieces of one generation; ``cancel()`` may be called from any thread. What it holds (its lease,
    its fetch engines) is released when it ends, fails or is closed, also when it was never iterated."""

    def __init__(self, engine: DecodeEngine, gen: Generation, pieces: Generator[str, None, None],
                 held: contextlib.ExitStack):
        self._engine, self._gen, self._pieces, self._held = engine, gen, pieces, held

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except BaseException:  # ended (StopIteration) or failed: let go of the prefix now
            self._held.close()
            raise

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at collection: best effort (the lease also lapses on its own)
            self.close()  # out of the engine first (waits out a step using it), then the fetch engines and lease

    def cancel(self) -> None:
        """Stop the generation: the consumer's next wait ends with ``Cancelled``."""
        self._engine.cancel(self._gen)

    def close(self) -> None:
        """End the generation now and release what it holds (from the consuming thread)."""
        try:
            self._pieces.close()
        finally:
            try:
                self._engine.close(self._gen)  # also when it was never iterated (its generator never ran)
            finally:
                self._held.close()


def drain_together(streams: Iterable[Iterator[str]]) -> None:
    """Pull one piece from each live stream in turn until every stream has ended (one thread consuming several
    generations, so every engine step serves them all). On an error the streams not yet ended are closed (what
    they hold is freed at once) and the error propagates."""
    live = list(streams)
    try:
        while live:
            for s in list(live):
                try:
                    next(s)
                except StopIteration:
                    live.remove(s)
    except BaseException:
        close_streams(live)
        raise


def close_streams(streams: Iterable[Iterator[str]]) -> None:
    """Close each stream that can be closed (what it holds is freed at once), for a caller that is handling an
    error: a close that fails is ignored, the caller's error is the one to report."""
    for s in streams:
        close = getattr(s, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def _finish_stats(gen: Generation, source: PrefixSource) -> None:
    """Fill a finished generation's read counters and engine figures."""
    st, lay = gen.stats, source.layout
    attn = gen.prefix
    if isinstance(attn, ReportsReads):
        report = attn.read_report()
        st.bytes_fetched = report.step_bytes + report.once_bytes  # methods/reads.py: every byte, summaries too
        st.prefix_tokens_per_step = report.tokens_per_step
        st.extra.update(report.extra)
        st.extra["bytes_summaries"] = float(report.once_bytes - report.once_kv_bytes)
    else:
        st.bytes_fetched = source.bytes_read
        st.prefix_tokens_per_step = [source.n_tokens * lay.n_layers * lay.n_kv_heads] * st.steps
    st.extra["summaries_s"] = source.artifact_s  # part of open_s (and of later steps', if a method reads late)
    st.extra["own_kv_bytes"] = float(gen.own.nbytes)  # what its own tokens' K/V came to
    st.extra["graph_steps"] = float(gen.graph_steps)  # steps replayed from a whole-step CUDA graph
    if gen.meter is not None:  # device memory it held at its peak (workers.device_bytes)
        gen.meter.sample()
        st.extra.update(gen.meter.to_extra())
    if gen.batch_sizes:
        st.extra["batch_mean"] = sum(gen.batch_sizes) / len(gen.batch_sizes)
        st.extra["batch_max"] = float(max(gen.batch_sizes))
    decode = st.step_seconds[1:]
    if decode:
        st.extra["ms_per_token"] = 1000 * sum(decode) / len(decode)
    st.seconds = time.perf_counter() - gen.started
