"""A whole decode step of a fixed batch of generations, captured in one CUDA graph and replayed per token.

A decode step launches hundreds of small kernels per layer (projections, norms, MLP, own-token
attention, the method's select + fetch + attend, the merge); launched one by one from Python they
cost far more than they run. When every generation of a step feeds one token and its method can
run captured (``GraphablePrefix``), the engine captures the model's whole forward for that batch
once and replays it while the batch stays the same: inputs (token ids, positions, each generation's
own length) live in a static device buffer that one host -> device copy fills per step; each
generation's own K/V is written where that buffer says (``OwnKV.write_at``) and attended up to it;
the methods' read counts stay on the device until ``account_step`` takes them after the replay.
Sampling stays outside the graph (it reads the static logits).

``StaticStep`` also runs uncaptured (``capture=False``): the same static-input forward, eagerly, so
the CPU tests check its tokens and counts against the ordinary packed step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import STEP_KWARG, GraphablePrefix, merge_attention
from workers.capture import graph_capture
from workers.own_kv import OwnKV
from workers.step_batch import own_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticMember:
    """One generation of a captured batch: its own K/V and its prefix attention."""

    own: OwnKV
    prefix: GraphablePrefix


class StaticStepBatch:
    """The ``StepAttention`` of a static step: member i's token is packed position i."""

    def __init__(self, members: list[StaticMember], lengths: torch.Tensor):
        self.members, self.lengths = members, lengths
        self.reads: list[list[torch.Tensor]] = [[] for _ in members]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[1, Hq, B, D]``, k, v ``[1, Hkv, B, D]`` -> out ``[1, Hq, B, D]`` (q's dtype)."""
        out = torch.empty_like(q)
        hq, hkv = q.shape[1], k.shape[1]
        for i, m in enumerate(self.members):
            at = self.lengths[i:i + 1]
            own_k, own_v = m.own.write_at(layer, k[0, :, i:i + 1], v[0, :, i:i + 1], at)
            qs = q[:, :, i:i + 1]
            n_valid = (at + 1).expand(1, hkv).contiguous()  # the kernel wants it dense
            o_own, lse_own = own_attention(qs[0, :, 0][None], own_k, own_v, n_valid, scale)
            o_pre, lse_pre, n_read = m.prefix.graph_attend(layer, qs, scale)
            if n_read is not None:
                self.reads[i].append(n_read.reshape(()))
            o_own4, lse_own3 = o_own.reshape(1, hq, 1, -1), lse_own.reshape(1, hq, 1)
            out[:, :, i:i + 1] = merge_attention(o_own4, lse_own3, o_pre, lse_pre)[0].to(q.dtype)
        return out


class StaticStep:
    """One batch's decode step over static inputs; captured in a CUDA graph unless ``capture`` is False."""

    def __init__(self, model: torch.nn.Module, members: list[StaticMember], device: torch.device, *, capture: bool):
        self.model, self.members, self.device = model, members, device
        n = len(members)
        self.inputs = torch.zeros((3, n), dtype=torch.long, device=device)
        """Rows: token ids, positions, own lengths (where each member's token goes in its own K/V)."""
        self._host = torch.zeros((3, n), dtype=torch.long, pin_memory=device.type == "cuda")
        self.logits = torch.empty(0)
        self.reads: list[torch.Tensor | None] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with graph_capture(self.graph, device):  # records only: run() replays
                self._forward()

    def _forward(self) -> None:
        batch = StaticStepBatch(self.members, self.inputs[2])
        hooks: dict[str, Any] = {STEP_KWARG: batch}
        out = self.model(input_ids=self.inputs[0:1], position_ids=self.inputs[1:2], use_cache=False,
                         logits_to_keep=0, **hooks)
        self.logits = out.logits[0].float()
        self.reads = [torch.stack(r) if r else None for r in batch.reads]

    def run(self, ids: list[int], positions: list[int], lengths: list[int]) -> torch.Tensor:
        """The step's logits ``[B, vocab]`` (static: read them before the next run); then each member's
        ``account_step`` with its reads."""
        self._host[0] = torch.tensor(ids)
        self._host[1] = torch.tensor(positions)
        self._host[2] = torch.tensor(lengths)
        self.inputs.copy_(self._host, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        for m, r in zip(self.members, self.reads, strict=True):
            m.prefix.account_step(None if r is None else list(r.clone().unbind()))
        return self.logits


class StepGraphCache:
    """The engine's captured steps, by batch: a batch is captured when it repeats the previous step's (a
    stable batch), replayed while it lasts, and dropped when one of its generations leaves."""

    MAX_GRAPHS = 4
    """Captured batches kept at once (each holds its own memory pool)."""
    MAX_FAILURES = 3
    """Failed captures after which no batch is captured any more (one batch's failure, e.g. its method's,
    must not take the graphs from every other batch; a capture that cannot work must not be retried forever)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, capture: bool):
        self.model, self.device, self.capture = model, device, capture
        self._steps: dict[object, StaticStep] = {}
        self._last: object = None
        self._failed_keys: set[object] = set()
        self.failures = 0
        self.failed = False
        """Set after ``MAX_FAILURES`` failed captures: the engine runs every later step eagerly."""
        self.captures = 0
        self.replays = 0

    def step(self, key: object, members: list[StaticMember]) -> StaticStep | None:
        """The static step of this batch, captured now if the previous step had the same batch; None: run this
        step the ordinary way."""
        last, self._last = self._last, key
        if self.failed:
            return None
        found = self._steps.get(key)
        if found is not None:
            self._steps[key] = self._steps.pop(key)  # most recently used last
            self.replays += 1
            return found
        if key != last or key in self._failed_keys:
            return None
        while len(self._steps) >= self.MAX_GRAPHS:
            self._steps.pop(next(iter(self._steps)))
        try:
            made = StaticStep(self.model, members, self.device, capture=self.capture)
        except Exception:  # noqa: BLE001 - a capture that fails leaves its batch eager, not broken
            self.failures += 1
            self._failed_keys.add(key)
            self.failed = self.failures >= self.MAX_FAILURES
            log.warning("capturing the decode step in a CUDA graph failed (%d of %d); this batch decodes eagerly",
                        self.failures, self.MAX_FAILURES, exc_info=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        self.captures += 1
        self._steps[key] = made
        return made

    def __len__(self) -> int:
        return len(self._steps)

    def prune(self, alive: set[int]) -> None:
        """Forget every captured step holding a generation whose own K/V (by ``id``) is not in ``alive`` (it
        left the engine: its buffers and prefix must not be kept by a graph)."""
        for key in [k for k, s in self._steps.items() if any(id(m.own) not in alive for m in s.members)]:
            del self._steps[key]
