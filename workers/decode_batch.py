"""Continuous batching: every running generation advances in one forward pass per step.

Generations join and leave between steps. A step packs, for each running generation, either the
next chunk of its query or its last sampled token (``EngineConfig.step_tokens`` bounds the packed
length, so a long query is taken in chunks and never stalls the others for long), runs the model
once, and samples one token for each generation whose input is complete. Different prefixes,
methods and budgets share a step: only attention is per generation (``workers.step_batch``).
Tenants share steps evenly (``EngineConfig.tenant_share``): a step's cost grows with what it serves,
so one tenant's many generations must not make every other tenant's tokens slower.

Nobody owns a stepping thread: a consumer that waits for its next piece runs the step itself when
no other step is running (the others' pieces come out of the same step), so one generation alone
costs no thread hop, and a step is taken only while someone waits for output.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal

import torch

from store.errors import Cancelled
from workers.attention import (
    STEP_KWARG,
    GraphablePrefix,
    ObservesQuery,
    PrefixAttention,
    RowAdapter,
    ScratchRows,
    TakesScratchRows,
    VerifiesSummaries,
)
from workers.device_bytes import DeviceMeter
from workers.model import LoadedModel
from workers.own_kv import OwnKV
from workers.ratplus import MEMORY_KWARG, has_decaying_memory
from workers.requests import GenerationStats
from workers.sampling import Sampler, sample_rows
from workers.step_ahead import AheadStep, DeviceTokens
from workers.step_batch import Segment, SegmentFailed, StepBatch
from workers.step_graph import Candidate, StaticMember, StaticStep, StepGraphCache
from workers.textstream import TextStream

StepTurn = Callable[[], AbstractContextManager[object]]
"""Held around each model step (a scheduler's turn on the model, shared with prefills)."""


RESERVE_AHEAD = 256
"""Own-token room a generation running in a captured step gets ahead of its steps (within its capacity): its
buffer, and so its captured group, changes at most every this many tokens (128 KiB a token for Llama-3.1-8B)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Bounds of one worker's decode steps."""

    max_batch: int = 64
    """Generations advanced together in one step (more running ones take turns, oldest first)."""
    step_tokens: int = 512
    """Packed tokens per step: decoding generations take one each, query chunks share the rest."""
    tenant_share: float = 1.0
    """A tenant advances at most this many times as many generations per step as the tenant running the
    fewest (1: every tenant gets the same tokens per step). A step costs more the more it serves, so
    without the bound one tenant's flood of generations would slow every other tenant's steps."""

    cuda_graphs: bool = True
    """On a CUDA device, replay each generation's fixed-shape prefix steps (Quest under a budget, over a warm
    or resident prefix) from per-layer CUDA graphs instead of launching their kernels one by one."""
    whole_step: Literal["auto", "off", "eager"] = "auto"
    """Decode steps of stable groups of generations whose methods can run captured (``workers.step_graph``):
    ``auto`` captures each group's whole model step in one CUDA graph (with ``cuda_graphs``, on a CUDA
    device; for a model with a decaying memory too, each member continuing its memory on the device); ``eager``
    runs the same static-input step uncaptured (tests it on the CPU); ``off`` never."""

    step_ahead: bool = True
    """Launch a stable captured batch's next step before this step's tokens reach the host, when every
    generation of the step is in it (``workers.step_ahead``): the device then never waits for the host between
    steps. Tokens (greedy or seeded sampling) and read counts are the same either way."""
    member_streams: int = 8
    """CUDA streams a whole step spreads its generations' attention over (1: all on the step's stream). Each
    generation's select + fetch + attend is a chain of small kernels; side by side they overlap."""

    def __post_init__(self) -> None:
        if not 1 <= self.member_streams <= 64:
            raise ValueError("member_streams must be in [1, 64]")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 1.0 <= self.tenant_share <= 1e6:
            raise ValueError("tenant_share must be in [1, 1e6]")
        if self.whole_step not in ("auto", "off", "eager"):
            raise ValueError("whole_step must be auto, off or eager")
        if self.step_tokens < self.max_batch:
            raise ValueError("step_tokens must be >= max_batch (each decoding generation feeds a token)")


@dataclass(eq=False, kw_only=True)
class Generation:
    """One running generation: its attention over the prefix, own KV, sampling and output."""

    prefix: PrefixAttention
    own: OwnKV
    pending: list[int]
    """Tokens to feed next: the rest of the query, then each sampled token."""
    position: int
    """Position of ``pending[0]`` (prefix tokens come first)."""
    sampler: Sampler
    text: TextStream
    eos_ids: frozenset[int]
    max_new: int
    stats: GenerationStats
    tenant: str = ""
    """Who asked (steps share the batch fairly across tenants)."""
    full_step_bytes: int
    """Bytes exact attention over the prefix reads per step (for ``stats.bytes_full``)."""
    pieces: deque[str] = field(default_factory=deque)
    done: bool = False
    cancelled: bool = False
    error: BaseException | None = None
    started: float = field(default_factory=time.perf_counter)
    wake: threading.Condition | None = None
    """Notified when a step changed this generation (set by ``DecodeEngine.start``)."""
    waiting: bool = False
    """Whether its consumer waits on ``wake``."""
    batch_sizes: list[int] = field(default_factory=list)
    query_told: bool = False
    """Whether its method was told the query is in (``VerifiesSummaries``, ``ObservesQuery``)."""
    single_steps: int = 0
    """Steps that fed it one token (the first runs eagerly: it warms what a captured step replays)."""
    graph_steps: int = 0
    """Steps it took in a whole-step CUDA graph (or its static-input form; ``workers.step_graph``)."""
    meter: DeviceMeter | None = None
    """Samples the device memory it holds (``workers.device_bytes``); sampled here when its query is in."""

    @property
    def runnable(self) -> bool:
        """Whether the next step should advance it."""
        return not (self.done or self.cancelled or self.error is not None)


class DecodeEngine:
    """Steps every running generation of one model together (thread-safe; consumers drive the steps)."""

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, turn: StepTurn = contextlib.nullcontext):
        self.lm, self.config, self.turn = lm, config or EngineConfig(), turn
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        """Notified when a step ends (``close`` waits for the step that may be using its generation)."""
        self._running: deque[Generation] = deque()
        self._stepping = False
        self._in_step: set[Generation] = set()
        """The generations of the step running now (``close`` waits for it only when it uses its generation)."""
        self._memory = has_decaying_memory(lm.model.config)
        """Whether the model continues a decaying memory (its step also gets the segments' states)."""
        c = self.config
        on_cuda = c.whole_step == "auto" and c.cuda_graphs and lm.device.type == "cuda"
        self._graphs = (StepGraphCache(lm.model, lm.device, capture=on_cuda, streams=c.member_streams)
                        if on_cuda or c.whole_step == "eager" else None)
        """Whole decode steps of stable batches (``workers.step_graph``); touched by the stepping thread, or
        under the lock while no step runs."""
        self._ahead: AheadStep | None = None
        """The next step, launched by the last one before its tokens reached the host (``workers.step_ahead``);
        set and taken under the lock."""
        self.ahead_steps = 0
        """Steps launched ahead of the host (``ahead_dropped`` of them unused: a generation ended first)."""
        self.ahead_dropped = 0

    def start(self, gen: Generation) -> None:
        """Join the next step."""
        with self._lock:
            gen.wake = threading.Condition(self._lock)
            self._running.append(gen)

    def cancel(self, gen: Generation) -> None:
        """Stop a generation: its waiting consumer gets ``Cancelled``; it takes no further step."""
        with self._lock:
            gen.cancelled = True
            if gen.wake is not None:
                gen.wake.notify()

    def close(self, gen: Generation) -> None:
        """Take a generation out for good (waits for a step that may be using it to end)."""
        with self._lock:
            gen.cancelled = gen.cancelled or not gen.done  # not runnable: no later step takes it
            while gen in self._in_step:  # not every running step: under load one follows another at once
                self._idle.wait()
            if self._ahead is not None and gen in self._ahead.gens:  # its buffers must outlive that step
                self._drop_ahead()
            if gen in self._running:
                self._running.remove(gen)
            if not self._stepping:  # else the step's end forgets it (only the stepper touches the graphs)
                self._prune_graphs()

    def running(self) -> int:
        """Generations in the engine now."""
        with self._lock:
            return len(self._running)

    def next_piece(self, gen: Generation) -> str | None:
        """The generation's next text piece, or None when it has ended; steps the engine while waiting."""
        assert gen.wake is not None, "start() the generation first"
        while True:
            with self._lock:
                if gen.pieces:
                    return gen.pieces.popleft()
                if gen.error is not None:
                    raise gen.error
                if gen.done:
                    return None
                if gen.cancelled:
                    raise Cancelled("the generation was cancelled")
                if self._stepping:
                    gen.waiting = True
                    gen.wake.wait()
                    gen.waiting = False
                    continue
                self._stepping = True
            batch: list[Generation] = []
            try:
                batch = self._step()
            finally:
                with self._lock:
                    self._stepping = False
                    self._in_step = set()
                    self._prune_graphs()
                    self._wake_after_step(gen, batch)

    def _drop_ahead(self) -> None:
        """Forget the launched next step once the device has finished it (lock held)."""
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None
            self.ahead_dropped += 1

    def _keep_ahead(self) -> None:
        """At a step's end (lock held): a launched next step whose generations all go on is theirs, timed from
        now; one with a generation that ended is dropped (the next step runs the ordinary way)."""
        if self._ahead is None:
            return
        if all(g.runnable for g in self._ahead.gens):
            self._ahead.since = time.perf_counter()
        else:
            self._drop_ahead()

    def _prune_graphs(self) -> None:
        """Forget captured steps of generations that left (lock held, no step running)."""
        if self._graphs is not None:
            self._graphs.prune({id(g) for g in self._running})

    def _wake_after_step(self, stepper: Generation, batch: list[Generation]) -> None:
        """Wake the consumers a step concerns, and one more to take the next step when the stepper will not
        (lock held). Only these: every consumer woken per step would fight the stepper for the interpreter."""
        self._idle.notify_all()
        for g in batch:
            if g.wake is not None:
                g.wake.notify()
        if stepper.runnable and not stepper.pieces:
            return  # it steps again itself
        nxt = next((g for g in self._running if g.waiting and g.runnable and g not in batch), None)
        if nxt is not None and nxt.wake is not None:
            nxt.wake.notify()

    # -- one step (called with _stepping held, outside the lock) ------------------------------------
    def _take_batch(self) -> list[Generation]:
        """The generations of the next step (lock held): up to ``max_batch``, oldest-served first, and no
        tenant with more than ``tenant_share`` times the generations of the tenant running fewest."""
        runnable = [g for g in self._running if g.runnable]
        demand = Counter(g.tenant for g in runnable)
        cap = max(1, int(self.config.tenant_share * min(demand.values(), default=1)))
        taken: Counter[str] = Counter()
        batch: list[Generation] = []
        for g in runnable:
            if len(batch) < self.config.max_batch and taken[g.tenant] < cap:
                taken[g.tenant] += 1
                batch.append(g)
        for g in batch:  # served: to the back of the line
            self._running.remove(g)
            self._running.append(g)
        return batch

    def _feeds(self, batch: list[Generation]) -> list[tuple[Generation, int]]:
        """Who takes part in the step, each with how many of its pending tokens it feeds: one when decoding, a
        chunk of what is left of ``step_tokens`` when its query is still going in."""
        budget = self.config.step_tokens - sum(1 for g in batch if len(g.pending) == 1)
        feeds: list[tuple[Generation, int]] = []
        for g in batch:
            if len(g.pending) == 1:
                n = 1
            else:
                n = min(len(g.pending), budget)
                if n < 1:
                    continue
                budget -= n
            feeds.append((g, n))
        return feeds

    @torch.inference_mode()
    def _step(self) -> list[Generation]:
        """One step of the generations running when the model is ours (returns them)."""
        t0 = time.perf_counter()
        batch: list[Generation] = []
        members: list[Generation] = []
        feeds: list[tuple[Generation, int]] = []
        graphed: set[Generation] = set()
        try:
            with self.turn():
                # Taken once the turn is ours, not before waiting for it: a generation that opened meanwhile
                # (opening takes a turn too) rides this step rather than waiting out one taken without it.
                with self._lock:
                    if self._ahead is not None and not all(g.runnable for g in self._ahead.gens):
                        self._drop_ahead()  # cancelled since: the ordinary way
                    ahead, self._ahead = self._ahead, None
                    batch = list(ahead.gens) if ahead is not None else self._take_batch()
                    self._in_step = set(batch)
                if not batch:
                    return batch
                logits: dict[Generation, torch.Tensor] = {}
                if ahead is not None:  # launched by the last step: already running
                    t0 = ahead.since
                    feeds = [(g, 1) for g in batch]
                    groups: list[tuple[StaticStep, list[Generation]]] = [(ahead.step, batch)]
                    rest: list[tuple[Generation, int]] = []
                    ahead.step.account(ahead.reads)
                    logits.update(zip(batch, ahead.step.logits, strict=True))
                    graphed.update(batch)
                else:
                    feeds = self._feeds(batch)
                    groups, rest = self._static_groups(feeds)
                    if rest:  # first: a failing segment then leaves no captured step run (nothing to undo)
                        logits.update(self._packed_step(rest))
                    for static, gens in groups:
                        rows = static.run([g.pending[0] for g in gens], [g.position for g in gens],
                                          [g.own.length for g in gens])
                        logits.update(zip(gens, rows, strict=True))
                        graphed.update(gens)
                members = [g for g, _ in feeds]
                sampled = [g for g, n in feeds if n == len(g.pending)]
                tokens = self._sample(sampled, logits, groups, rest)  # syncs: this step done
        except SegmentFailed as e:  # one generation's method failed: fail it alone, the others retry
            with self._lock:
                self._drop_ahead()
                g = e.key
                assert isinstance(g, Generation)
                g.error = e.cause
            return batch
        except BaseException as e:  # the model itself failed: every generation of the step fails
            if not members:  # nothing was stepped (the turn itself failed): the stepper's caller sees it
                raise
            with self._lock:
                self._drop_ahead()
                for g in members:
                    g.error = e
            return batch
        seconds = time.perf_counter() - t0
        with self._lock:
            for g, n in feeds:
                g.own.commit(n)
                g.position += n
                g.pending = g.pending[n:]
                g.stats.steps += 1
                g.single_steps += n == 1
                g.graph_steps += g in graphed
                g.stats.bytes_full += g.full_step_bytes
                g.stats.step_seconds.append(seconds)
                g.batch_sizes.append(len(members))
        failed = self._queries_done(sampled)
        with self._lock:
            for g, token in zip(sampled, tokens, strict=True):
                if g not in failed:
                    self._emit(g, token)
            self._keep_ahead()
        return batch

    def _sample(self, sampled: list[Generation], logits: dict[Generation, torch.Tensor],
                groups: list[tuple[StaticStep, list[Generation]]], rest: list[tuple[Generation, int]]) -> list[int]:
        """The sampled generations' tokens; first the next step, when it can go ahead of them."""
        nxt = self._ahead_group(sampled, groups, rest)
        if nxt is None:
            return sample_rows([g.sampler for g in sampled], [logits[g] for g in sampled])
        static, gens = nxt
        picks = DeviceTokens(static.logits, [g.sampler for g in gens])  # before the next launch overwrites them
        reads = static.run_next(picks.device)
        assert self._graphs is not None
        self._graphs.replays += 1
        with self._lock:
            self._ahead = AheadStep(static, gens, reads)
            self.ahead_steps += 1
        by_gen = dict(zip(gens, picks.tolist(), strict=True))
        return [by_gen[g] for g in sampled]

    def _ahead_group(self, sampled: list[Generation], groups: list[tuple[StaticStep, list[Generation]]],
                     rest: list[tuple[Generation, int]]) -> tuple[StaticStep, list[Generation]] | None:
        """The static group whose next step can be launched now (``workers.step_ahead``): the step's only one,
        holding every runnable generation, each sampling now and with a token to go after this one, room in its
        buffer and its captured key unchanged."""
        if not self.config.step_ahead or self._graphs is None or rest or len(groups) != 1:
            return None
        static, gens = groups[0]
        if set(sampled) != set(gens):
            return None
        with self._lock:
            if any(g.runnable != (g in gens) for g in self._running):
                return None  # someone else waits its turn, or a member stopped
        for g in gens:
            if g.stats.new_tokens + 2 > g.max_new or g.text.stopped or g.own.length + 2 > g.own.buffer_key[1]:
                return None
        keys = [(id(g), g.own.buffer_key, g.prefix.graph_key() if isinstance(g.prefix, GraphablePrefix) else None)
                for g in gens]
        return (static, gens) if self._graphs.holds(static, keys) else None

    def _packed_step(self, feeds: list[tuple[Generation, int]]) -> dict[Generation, torch.Tensor]:
        """The ordinary step: these feeds packed into one forward pass; the logits of each generation whose
        input is then complete."""
        dev = self.lm.device
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        rows: list[int] = []
        sampled: list[Generation] = []
        scratch: list[tuple[int, ScratchRows]] = []
        for g, n in feeds:
            start = len(ids)
            ids += g.pending[:n]
            positions += range(g.position, g.position + n)
            extra = 0
            if n == len(g.pending):
                rows.append(start + n - 1)
                sampled.append(g)
                if (not g.stats.new_tokens and not g.query_told and isinstance(g.prefix, TakesScratchRows)
                        and (sr := g.prefix.scratch_rows()) is not None):  # its query's last step: ride along
                    extra = sr.embeddings.shape[0]
                    scratch.append((start + n, sr))
                    ids += [0] * extra  # placeholders: their embeddings are the method's
                    positions += range(g.position + n, g.position + n + extra)
            segments.append(Segment(start, start + n + extra, g.own, g.prefix, g, scratch=extra))
        step = StepBatch(segments)
        hooks: dict[str, object] = {STEP_KWARG: step, **({MEMORY_KWARG: step} if self._memory else {})}
        input_ids = torch.tensor([ids], device=dev)
        with contextlib.ExitStack() as active:
            inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
            if scratch:
                inputs = {"inputs_embeds": self._with_scratch_rows(input_ids, scratch, active)}
            out = self.lm.model(**inputs, position_ids=torch.tensor([positions], device=dev), use_cache=False,
                                logits_to_keep=torch.tensor(rows, dtype=torch.long, device=dev), **hooks)
        return dict(zip(sampled, out.logits[0].float(), strict=True))

    def _with_scratch_rows(self, input_ids: torch.Tensor, scratch: list[tuple[int, ScratchRows]],
                           active: contextlib.ExitStack) -> torch.Tensor:
        """The packed step's input embeddings with each method's scratch rows in place; each distinct adapter's
        block entered on ``active`` with the mask of its rows."""
        emb = self.lm.model.get_input_embeddings()(input_ids)
        masks: dict[int, tuple[RowAdapter, torch.Tensor]] = {}
        for at, sr in scratch:
            n = sr.embeddings.shape[0]
            emb[0, at:at + n] = sr.embeddings.to(emb.dtype)
            _, mask = masks.setdefault(id(sr.adapter), (sr.adapter, torch.zeros_like(input_ids, dtype=torch.bool)))
            mask[0, at:at + n] = True
        for adapter, mask in masks.values():
            active.enter_context(adapter.active(mask))
        return emb

    def _static_groups(self, feeds: list[tuple[Generation, int]]
                       ) -> tuple[list[tuple[StaticStep, list[Generation]]], list[tuple[Generation, int]]]:
        """The captured (or static-input) steps serving some of this step's generations, each with its members
        in order, and the feeds left to the ordinary packed step. A generation can run static when it feeds
        one token, has taken one eager single step (it warms what a captured step replays) and its method can
        run captured (``workers.step_graph``)."""
        if self._graphs is None:
            return [], feeds
        candidates: list[Candidate] = []
        at: list[int] = []
        for j, (g, n) in enumerate(feeds):
            p = g.prefix
            if n != 1 or g.single_steps < 1 or not isinstance(p, GraphablePrefix):
                continue
            key = p.graph_key()
            if key is None:
                continue
            steps_left = max(1, g.max_new - g.stats.new_tokens)
            # A captured step cannot grow the buffer: room first, then its key. Room for the steps ahead (up to
            # RESERVE_AHEAD) at once: each growth changes the key and drops the generation's captured group.
            g.own.reserve(min(g.own.capacity, g.own.length + min(steps_left, RESERVE_AHEAD)))
            candidates.append(Candidate((id(g), g.own.buffer_key, key), StaticMember(own=g.own, prefix=p),
                                        steps_left=steps_left))
            at.append(j)
        plans, _ = self._graphs.plan(candidates)
        groups = [(static, [feeds[at[i]][0] for i in idx]) for static, idx in plans]
        static_gens = {g for _, gens in groups for g in gens}
        return groups, [f for f in feeds if f[0] not in static_gens]

    def _queries_done(self, sampled: list[Generation]) -> set[Generation]:
        """For generations whose query just went in (their first token is not out yet): check the summaries their
        query's forward used, and tell query-time caches; returns the generations whose method failed there (each
        fails alone)."""
        failed: set[Generation] = set()
        for g in sampled:
            if g.stats.new_tokens or g.query_told:
                continue
            g.query_told = True
            try:
                if isinstance(g.prefix, VerifiesSummaries):  # a wait on the disk at most: outside the model's turn
                    g.prefix.verify_summaries()
                if not isinstance(g.prefix, ObservesQuery):
                    continue
                if g.meter is not None:  # a query-time cache holds the whole layers now, until query_done
                    g.meter.sample()
                with self.turn(), torch.inference_mode():
                    g.prefix.query_done(g.own, g.position)
            except Exception as e:  # noqa: BLE001 - the method's failure is its generation's
                with self._lock:
                    g.error = e
                failed.add(g)
        return failed

    def _emit(self, g: Generation, token: int) -> None:
        """Hand one sampled token to its generation (lock held)."""
        st = g.stats
        if st.new_tokens == 0 and "ttft_s" not in st.extra:
            st.extra["ttft_s"] = time.perf_counter() - g.started
        if token in g.eos_ids:
            st.finish_reason = "eos"
            g.done = True
        else:
            st.new_tokens += 1
            st.token_ids.append(token)
            if piece := g.text.push(token):
                g.pieces.append(piece)
        if g.done:
            pass
        elif g.text.stopped:
            st.finish_reason = "stop"
            g.done = True
        elif st.new_tokens >= g.max_new:
            st.finish_reason = "length"
            g.done = True
        else:
            g.pending = [token]
        if g.done and (tail := g.text.finish()):
            g.pieces.append(tail)
