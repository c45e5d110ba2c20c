"""The worker: prefill a document into the store once, then generate answers from it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from store.artifacts import tensors_to_bytes
from store.errors import ContextTooLong, InvalidInput, ModelMismatch
from store.kvstore import KVStore
from store.manifest import Manifest
from store.prefix_key import PrefixKey, tenant_salt, token_hash
from workers.attention import PREFIX_KWARG, PrefixAttention
from workers.methods.base import ReportsReads
from workers.methods.registry import build_summarizers, get_method, prefill_summarizers
from workers.methods.source import PrefixSource
from workers.model import LoadedModel
from workers.offload import HostTier, OffloadConfig, PageFetcher
from workers.offload.fast_path import FastOpen
from workers.offload.summaries import SummaryCache
from workers.prefill import DEFAULT_CHUNK, prefill_kv
from workers.requests import DecodeConfig, GenerationStats, SamplingParams
from workers.sampling import Sampler
from workers.textstream import TextStream

DEFAULT_TENANT = "default"
DEFAULT_OFFLOAD = OffloadConfig()
StepTurn = Callable[[], AbstractContextManager[object]]
"""Held around each decode step (a fair scheduler's turn on the model); may raise to stop the generation."""


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What a prefill produced: the prefix id, its size, and whether it was already stored."""

    prefix_id: str
    n_tokens: int
    cached: bool
    manifest: Manifest


def _close_fetch(source: PrefixSource) -> None:
    """Release a generation's fetch engines (the device cache first: it holds host-tier slots; closing the
    fetcher stops its background warm-up)."""
    if source.device_cache is not None:
        source.device_cache.close()
    if source.fetcher is not None:
        source.fetcher.close()


class Worker:
    """Prefills documents into a store and decodes queries over stored prefixes."""

    def __init__(self, store: KVStore, lm: LoadedModel, *, secret: str = "", chunk_size: int = DEFAULT_CHUNK,
                 progress: bool = True, offload: OffloadConfig | None = DEFAULT_OFFLOAD):
        self.store, self.lm, self.secret = store, lm, secret
        self.chunk_size, self.progress = chunk_size, progress
        self.offload = offload
        """Tiered per-step page fetch for sparse methods (None: each layer read once and held)."""
        self._host: HostTier | None = None
        self._host_lock = threading.Lock()
        self.summaries = SummaryCache((offload or DEFAULT_OFFLOAD).summary_cache_bytes)
        """Parsed summaries and page-CRC tables of recently opened prefixes (host memory, LRU)."""
        if lm.layout.page_size != store.config.page_size:
            raise ValueError("model layout and store disagree on page_size")

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

    def prefill(self, document: str, tenant: str = DEFAULT_TENANT) -> PrefillResult:
        """Store a document's KV and summaries unless an identical prefix exists (then no forward pass)."""
        ids = self.tokenize_document(document)
        key = self.prefix_key(ids, tenant)
        pid = key.prefix_id
        if (m := self.store.find(pid)) is not None:
            return PrefillResult(prefix_id=pid, n_tokens=m.n_tokens, cached=True, manifest=m)
        with self.store.prefill_lock(pid):  # single flight across processes and hosts sharing the metadata
            if (m := self.store.find(pid)) is not None:
                return PrefillResult(prefix_id=pid, n_tokens=m.n_tokens, cached=True, manifest=m)
            m = self._write_prefix(key, ids, tenant)
        return PrefillResult(prefix_id=pid, n_tokens=len(ids), cached=False, manifest=m)

    def _write_prefix(self, key: PrefixKey, ids: list[int], tenant: str) -> Manifest:
        summarizers = build_summarizers(self.lm.phi_map)
        parts: dict[str, dict[str, torch.Tensor]] = {s.name: {} for s in summarizers}
        with self.store.write_prefix(key, model_name=self.lm.name, n_tokens=len(ids), tenant=tenant) as w:
            for layer, k, v in prefill_kv(self.lm, ids, chunk_size=self.chunk_size, progress=self.progress):
                w.write_layer(layer, k, v)
                for s in summarizers:
                    for name, t in s.summarize(layer, k, v).items():
                        parts[s.name][f"{layer}.{name}"] = t
            for s in summarizers:
                w.put_artifact(s.name, tensors_to_bytes(parts[s.name]))
            return w.commit()

    def remove_prefix(self, prefix_id: str) -> None:
        """Delete a stored prefix and forget its cached summaries."""
        self.store.remove(prefix_id)
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
                 stats: GenerationStats | None = None, raw: bool = False,
                 turn: StepTurn = contextlib.nullcontext) -> Iterator[str]:
        """Stream the answer to ``query`` over a stored prefix, as text pieces.

        The query is wrapped in the model's query template unless ``raw``; ``turn()`` is held around
        each decode step, so interleaved generations take the model one step at a time.
        """
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
        impl = get_method(method, self.lm.phi_map)
        source = PrefixSource(self.store, m, self.lm.device, summaries=self.summaries)
        try:
            if impl.fetches_pages and self.offload is not None:
                source.fetcher = PageFetcher(self.store, m, self.lm.device, self.offload, self.host_tier(),
                                             summaries=self.summaries)
                fast = FastOpen(source.fetcher, self.offload)  # warms the host tier (in the background)
                source.device_cache, source.switch = fast.device_cache, fast.poll
            attn = impl.open(source, decode or DecodeConfig())
        except BaseException:
            _close_fetch(source)
            raise
        stop = params.stop or self.lm.prompt.stop
        return self._leased(attn, source, q_ids, params, stop, min(room, params.max_new_tokens),
                            stats if stats is not None else GenerationStats(), turn)

    def _leased(self, attn: PrefixAttention, source: PrefixSource, q_ids: list[int], params: SamplingParams,
                stop: tuple[str, ...], max_new: int, stats: GenerationStats, turn: StepTurn) -> Iterator[str]:
        # A live lease keeps eviction away from the prefix while it is decoded; released however the stream ends.
        try:
            with self.store.lease(source.manifest.prefix_id) as lease:
                for piece in self._stream(attn, source, source.n_tokens, q_ids, params, stop, max_new, stats, turn):
                    lease.keepalive()
                    yield piece
        finally:
            _close_fetch(source)

    @torch.inference_mode()
    def _stream(self, attn: PrefixAttention, source: PrefixSource, n_prefix: int, q_ids: list[int],
                params: SamplingParams, stop: tuple[str, ...], max_new: int, stats: GenerationStats,
                turn: StepTurn) -> Iterator[str]:
        t0 = time.perf_counter()
        lm, dev = self.lm, self.lm.device
        sampler, text = Sampler(params, dev), TextStream(lm.tokenizer, stop)
        cache = DynamicCache(config=lm.model.config)
        ids, pos = q_ids, n_prefix
        stats.prompt_tokens, stats.finish_reason = len(q_ids), "length"
        full_step_bytes = n_prefix * lm.layout.token_kv_bytes() * lm.layout.n_kv_heads * lm.layout.n_layers
        for _ in range(max_new):
            with turn():
                t_step = time.perf_counter()
                inp = torch.tensor([ids], device=dev)
                positions = torch.arange(pos, pos + len(ids), device=dev)[None]
                out = lm.model(input_ids=inp, position_ids=positions, past_key_values=cache, use_cache=True,
                               logits_to_keep=1, **{PREFIX_KWARG: attn})
                token = sampler(out.logits[0, -1])  # syncs the device: the step is done when the turn ends
                stats.step_seconds.append(time.perf_counter() - t_step)
            pos += len(ids)
            stats.steps += 1
            stats.bytes_full += full_step_bytes
            if token in lm.eos_ids:
                stats.finish_reason = "eos"
                break
            stats.new_tokens += 1
            stats.token_ids.append(token)
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                stats.finish_reason = "stop"
                break
            ids = [token]
        if tail := text.finish():
            yield tail
        if isinstance(attn, ReportsReads):
            report = attn.read_report()
            stats.bytes_fetched = report.step_bytes + report.once_kv_bytes
            stats.prefix_tokens_per_step = report.tokens_per_step
            stats.extra.update(report.extra)
            stats.extra["bytes_summaries"] = float(report.once_bytes - report.once_kv_bytes)
        else:
            stats.bytes_fetched = source.bytes_read
            stats.prefix_tokens_per_step = [n_prefix * lm.layout.n_layers * lm.layout.n_kv_heads] * stats.steps
        stats.seconds = time.perf_counter() - t0
