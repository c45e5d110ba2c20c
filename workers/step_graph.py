"""A whole decode step of a fixed group of generations, captured in one CUDA graph and replayed per token.

A decode step launches hundreds of small kernels per layer (projections, norms, MLP, own-token
attention, the method's select + fetch + attend, the merge); launched one by one from Python they
cost far more than they run. For generations that feed one token and whose methods can run captured
(``GraphablePrefix``), the engine captures the model's whole forward over a group of them once and
replays it while the group lasts (``StepGraphCache`` says which groups serve a step): inputs (token
ids, positions, each generation's own length) live in a static device buffer that one host -> device
copy fills per step; each generation's own K/V is written where that buffer says (all members' rows in one
launch, ``write_own_rows``) and attended up to it; the methods' read counts stay on the device until
``account_step`` takes them after the replay.
Sampling stays outside the graph (it reads the static logits).

``StaticStep`` also runs uncaptured (``capture=False``): the same static-input forward, eagerly, so
the CPU tests check its tokens and counts against the ordinary packed step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import STEP_KWARG, GraphablePrefix
from workers.capture import graph_capture
from workers.kernels.own_rows import own_rows_table, write_own_rows
from workers.methods.pages_together import PagesTogether, PicksPagesTogether
from workers.own_kv import OwnKV
from workers.ratplus import MEMORY_KWARG, has_decaying_memory
from workers.step_batch import own_and_prefix_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticMember:
    """One generation of a captured batch: its own K/V and its prefix attention."""

    own: OwnKV
    prefix: GraphablePrefix


_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}
"""Side streams per CUDA device, made once and kept: a captured graph's branches were recorded on them."""


def member_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """``n`` side streams of ``device`` (the same ones every call) for members' attention to run side by side."""
    pool = _STREAMS.setdefault(device, [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device))
    return pool[:n]


class StaticStepBatch:
    """The ``StepAttention`` of a static step: member i's token is packed position i.

    Made before the step is captured (it copies small tables of the members' buffers to the device). At every
    layer, on the step's stream, every member's new K/V row goes into its own buffer in one launch
    (``write_own_rows``), and members whose page selections have the same shape pick their pages together
    (``PagesTogether``: one scoring and one top-k launch per group). Then each member's fetch + attend + own-token
    attention runs on up to ``streams`` side streams on CUDA (member i on stream i mod streams), forked from and
    joined back into the step's stream, writing its column of the output in place. Each member's work is a chain
    of small kernels that fill a fraction of the GPU; in a captured step the branches become parallel graph
    nodes, so the members' chains overlap instead of running one after another. Members share no written state
    (each has its own K/V buffer, page cache and outputs; the page bounds and the host tier are only read), so
    the order between them is free."""

    def __init__(self, members: list[StaticMember], lengths: torch.Tensor, streams: int = 1):
        self.members, self.lengths = members, lengths
        self.streams = streams
        self._bounds = torch.arange(len(members) + 1, dtype=torch.int32, device=lengths.device)
        """Member i's token is packed position i: one-token segments (a decaying memory's scan bounds)."""
        self.reads: list[list[torch.Tensor]] = [[] for _ in members]
        self._n_valid: torch.Tensor | None = None
        """``[B, Hkv]`` each member's own tokens this step, its new one included (made at the first layer)."""
        n_layers = members[0].own.n_layers if members else 0
        self._own = [own_rows_table([m.own.buffer(layer)[0] for m in members],
                                    [m.own.buffer(layer)[1] for m in members]) for layer in range(n_layers)]
        self.together = PagesTogether([m.prefix.graph_page_scoring if isinstance(m.prefix, PicksPagesTogether)
                                       else None for m in members], n_layers)

    def reset(self) -> None:
        """Before a forward: no reads collected yet."""
        self.reads = [[] for _ in self.members]
        self._n_valid = None

    def memory_segments(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a model with a decaying memory (``workers.ratplus.MemorySegments``): one-token segments, each
        continuing from its member's last own K, V (at ``lengths - 1``, read on the device: a captured step replays
        it with each step's lengths). A static member has fed its query, so it has an own token to continue."""
        rows = [(m.own.buffer(layer), (self.lengths[i:i + 1] - 1).clamp_min(0)) for i, m in enumerate(self.members)]
        k0 = torch.stack([kv[0].index_select(1, at)[:, 0] for kv, at in rows])
        v0 = torch.stack([kv[1].index_select(1, at)[:, 0] for kv, at in rows])
        return self._bounds, k0, v0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, B, D]``, k, v ``[1, Hkv, B, D]`` -> out ``[1, Hq, B, D]`` (q's dtype)."""
        out = torch.empty_like(q)
        hkv = k.shape[1]
        if self._n_valid is None:  # once per step (the first layer), for every layer: the kernel wants it dense
            self._n_valid = (self.lengths + 1)[:, None].expand(-1, hkv).contiguous()
        write_own_rows(k[0].transpose(0, 1), v[0].transpose(0, 1), self.lengths, self._own[layer])
        picked = self.together.pick(layer, q, scale)
        n_streams = min(self.streams, len(self.members)) if q.is_cuda else 1
        side = member_streams(q.device, n_streams) if n_streams > 1 else []
        main = torch.cuda.current_stream(q.device) if side else None
        for st in side:
            assert main is not None
            st.wait_stream(main)
        for i, m in enumerate(self.members):
            with torch.cuda.stream(side[i % n_streams]) if side else contextlib.nullcontext():
                own_k, own_v = m.own.buffer(layer)
                qs = q[:, :, i:i + 1]
                if i in picked:
                    assert isinstance(m.prefix, PicksPagesTogether)
                    o_pre, lse_pre, n_read = m.prefix.graph_attend_pages(layer, qs, scale, picked[i])
                else:
                    o_pre, lse_pre, n_read = m.prefix.graph_attend(layer, qs, scale)
                if n_read is not None:
                    self.reads[i].append(n_read.reshape(()))
                own_and_prefix_attention(qs[0, :, 0][None], own_k, own_v, self._n_valid[i:i + 1], scale,
                                         o_pre.reshape(1, q.shape[1], q.shape[3]), lse_pre.reshape(1, q.shape[1]),
                                         out=out[:, :, i])
        for st in side:  # the step's later kernels (and the next layer's fork) wait for every member
            assert main is not None
            main.wait_stream(st)
        return out


class StaticStep:
    """One batch's decode step over static inputs; captured in a CUDA graph unless ``capture`` is False."""

    def __init__(self, model: torch.nn.Module, members: list[StaticMember], device: torch.device, *, capture: bool,
                 streams: int = 1):
        self.model, self.members, self.device, self.streams = model, members, device, streams
        n = len(members)
        self.inputs = torch.zeros((3, n), dtype=torch.long, device=device)
        """Rows: token ids, positions, own lengths (where each member's token goes in its own K/V)."""
        self._host = torch.zeros((3, n), dtype=torch.long, pin_memory=device.type == "cuda")
        self.logits = torch.empty(0)
        self.reads: torch.Tensor | None = None
        """``[B, n_layers]`` tokens each member read per layer (static: cloned after each run), or None when no
        member's method counts reads."""
        self._counts: list[bool] = []
        """Whether member i's method returned read counts."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self._batch = StaticStepBatch(members, self.inputs[2], streams)
        self._memory = has_decaying_memory(getattr(model, "config", None))  # type: ignore[arg-type]  # test fakes have none
        if self._memory and any(m.own.length < 1 for m in members):
            raise ValueError("a model with a decaying memory runs a static step only after each member's query")
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with graph_capture(self.graph, device):  # records only: run() replays
                self._forward()

    def _forward(self) -> None:
        batch = self._batch
        batch.reset()
        hooks: dict[str, Any] = {STEP_KWARG: batch, **({MEMORY_KWARG: batch} if self._memory else {})}
        out = self.model(input_ids=self.inputs[0:1], position_ids=self.inputs[1:2], use_cache=False,
                         logits_to_keep=0, **hooks)
        self.logits = out.logits[0].float()
        self._counts = [bool(r) for r in batch.reads]
        n_layers = max((len(r) for r in batch.reads), default=0)
        zeros: torch.Tensor | None = None
        rows: list[torch.Tensor] = []
        for r in batch.reads:  # one [B, n_layers] buffer: one clone per run, not one per member
            if r:
                rows.append(torch.stack([x.long() for x in r]))
                continue
            if zeros is None:
                zeros = torch.zeros(n_layers, dtype=torch.long, device=self.device)
            rows.append(zeros)
        self.reads = torch.stack(rows) if n_layers else None

    def run(self, ids: list[int], positions: list[int], lengths: list[int]) -> torch.Tensor:
        """The step's logits ``[B, vocab]`` (static: read them before the next run); then each member's
        ``account_step`` with its reads."""
        self._host[0] = torch.tensor(ids)
        self._host[1] = torch.tensor(positions)
        self._host[2] = torch.tensor(lengths)
        self.inputs.copy_(self._host, non_blocking=True)
        self.account(self.launch())
        return self.logits

    def run_next(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Launch the members' next step on the device: ``tokens`` ``[B]`` (on the device, e.g. this step's
        greedy picks) at the next positions; returns its reads for ``account`` (nothing waits for the device)."""
        self.inputs[0].copy_(tokens)
        self.inputs[1:].add_(1)
        return self.launch()

    def launch(self) -> torch.Tensor | None:
        """Run the step over ``inputs`` (a replay when captured); returns a copy of its reads (None: none
        counted). The logits stay in ``logits`` until the next launch."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        return self.reads.clone() if self.reads is not None else None

    def account(self, reads: torch.Tensor | None) -> None:
        """Each member's ``account_step`` for a launched step whose result is used (``reads`` from ``launch``)."""
        for i, (m, counts) in enumerate(zip(self.members, self._counts, strict=True)):
            m.prefix.account_step(reads[i] if counts and reads is not None else None)


MemberKey = tuple[int, object, object]
"""A candidate's key: its generation's ``id``, its own buffer's address and size, its prefix's ``graph_key``."""


@dataclass(frozen=True)
class Candidate:
    """A generation of this step that could run in a static step: what a captured step over it depends on,
    and its static parts."""

    key: MemberKey
    member: StaticMember
    steps_left: int | None = None
    """The most steps its generation may still take (None: unknown); a group lasts no longer than its members."""


@dataclass(eq=False)
class _Group:
    keys: tuple[MemberKey, ...]
    """Its members' keys, in the captured step's member order."""
    step: StaticStep


class StepGraphCache:
    """The engine's captured steps, each over a group of generations.

    A step replays every kept group all of whose generations take part (with unchanged keys), and runs the
    rest the ordinary way. The rest's *warm* generations (those already in an earlier step's rest under the
    same key) are captured as a new group: a generation joining a running batch then costs one small
    capture of its own, not a new capture of everyone with it, and the running groups keep replaying
    meanwhile; generations that take turns (a tenant's share of the batch rotating over its generations)
    each get a group and replay when their turn comes. A generation's first step in the rest runs eagerly,
    so a group is never captured for a set that does not come back. Groups are merged into one
    when the same generations have run split over several of them for ``MERGE_AFTER`` steps (one forward
    serves them all: the weights are read once per step, not once per group). A group is dropped when one of
    its generations leaves or changes key.
    """

    MAX_GRAPHS = 8
    """Captured groups kept at once (each holds its own memory pool)."""
    MAX_WARM = 1024
    """Keys remembered as seen in a rest (forgotten with their generation, or all at once past this)."""
    MAX_FAILURES = 3
    """Failed captures after which nothing is captured any more (one group's failure, e.g. its method's,
    must not take the graphs from every other group; a capture that cannot work must not be retried forever)."""
    MERGE_AFTER = 4
    """Steps the same generations run split over several groups before one capture merges them. Each group's
    replay reads every weight of the model again, so a batch split over g groups pays about g - 1 extra
    weight passes per step; merging costs one capture. Generations arriving a step or two apart (a burst of
    requests opening one after another) then share one forward a few steps later, not after a dozen split
    steps; a merge waits for members expected to last at least this many more steps."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, capture: bool, streams: int = 1):
        self.model, self.device, self.capture, self.streams = model, device, capture, streams
        self._groups: list[_Group] = []
        """Kept groups, least recently used first."""
        self._warm: set[MemberKey] = set()
        """Keys seen in an earlier step's rest."""
        self._last_all: frozenset[MemberKey] = frozenset()
        self._same_steps = 0
        """Steps in a row with the same candidates (``_last_all``) before this one."""
        self._failed_keys: set[frozenset[MemberKey]] = set()
        self.failures = 0
        self.failed = False
        """Set after ``MAX_FAILURES`` failed captures: the engine runs every later step eagerly."""
        self.captures = 0
        self.replays = 0
        """Group replays (a step replaying two groups counts two)."""
        self.merges = 0

    def plan(self, candidates: list[Candidate]) -> tuple[list[tuple[StaticStep, list[int]]], list[int]]:
        """The static steps that serve this step's candidates, each with the candidates' indices in its member
        order, and the indices of the candidates left to the ordinary step."""
        keys = [c.key for c in candidates]
        all_keys = frozenset(keys)
        self._same_steps = self._same_steps + 1 if all_keys == self._last_all else 0
        self._last_all = all_keys
        if self.failed:
            return [], list(range(len(candidates)))
        self._drop_stale(candidates)
        index = {k: i for i, k in enumerate(keys)}
        used: list[_Group] = []
        for g in reversed(self._groups):  # most recently used first; groups of one step never share a member
            if all(k in index for k in g.keys) and not any(k in u.keys for u in used for k in g.keys):
                used.append(g)
        rest = [i for i, k in enumerate(keys) if not any(k in g.keys for g in used)]
        warm = [i for i in rest if keys[i] in self._warm]
        if len(self._warm) + len(rest) > self.MAX_WARM:
            self._warm.clear()
        self._warm.update(keys[i] for i in rest)
        replayed = len(used)  # of groups captured before this step
        if warm and frozenset(keys[i] for i in warm) not in self._failed_keys:
            made = self._capture([candidates[i] for i in warm], keep=used)
            if made is not None:
                used.append(made)
                rest = [i for i in rest if i not in warm]
        elif (not rest and len(used) > 1 and self._same_steps >= self.MERGE_AFTER
              and all_keys not in self._failed_keys
              and all(c.steps_left is None or c.steps_left >= self.MERGE_AFTER for c in candidates)):
            merged = self._capture(candidates, keep=used, replacing=len(used))
            if merged is not None:
                self._groups = [g for g in self._groups if g not in used]
                self._groups.append(merged)
                used, replayed = [merged], 0
                self.merges += 1
        for g in used:  # most recently used last
            self._groups.remove(g)
            self._groups.append(g)
        self.replays += replayed
        return [(g.step, [index[k] for k in g.keys]) for g in used], rest

    def _drop_stale(self, candidates: list[Candidate]) -> None:
        """Forget groups holding a generation of this step under another key (its buffer grew, or its prefix's
        captured state changed): they can never be replayed again."""
        now = {c.key[0]: c.key for c in candidates}
        self._groups = [g for g in self._groups if all(now.get(k[0], k) == k for k in g.keys)]

    def _capture(self, candidates: list[Candidate], keep: list[_Group], replacing: int = 0) -> _Group | None:
        """A new group over these candidates (None: its capture failed, or no room beside ``keep``, of which
        ``replacing`` groups go once it is made)."""
        keyset = frozenset(c.key for c in candidates)
        while len(self._groups) - replacing >= self.MAX_GRAPHS:
            victim = next((g for g in self._groups if g not in keep), None)
            if victim is None:
                return None
            self._groups.remove(victim)
        try:
            made = StaticStep(self.model, [c.member for c in candidates], self.device, capture=self.capture,
                              streams=self.streams)
        except Exception:  # noqa: BLE001 - a capture that fails leaves its generations eager, not broken
            self.failures += 1
            self._failed_keys.add(keyset)
            self.failed = self.failures >= self.MAX_FAILURES
            log.warning("capturing the decode step in a CUDA graph failed (%d of %d); these generations decode "
                        "eagerly", self.failures, self.MAX_FAILURES, exc_info=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        self.captures += 1
        group = _Group(tuple(c.key for c in candidates), made)
        if not replacing:
            self._groups.append(group)
        return group

    def holds(self, step: StaticStep, keys: Sequence[MemberKey]) -> bool:
        """Whether ``step`` is a kept group's, captured over members with exactly ``keys`` (in order)."""
        return any(g.step is step and g.keys == tuple(keys) for g in self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def prune(self, alive: set[int]) -> None:
        """Forget every captured step holding a generation (by ``id``) not in ``alive`` (it left the engine: its
        buffers and prefix must not be kept by a graph), and what was remembered of it."""
        self._groups = [g for g in self._groups if all(k[0] in alive for k in g.keys)]
        self._warm = {k for k in self._warm if k[0] in alive}
