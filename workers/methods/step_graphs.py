"""CUDA graphs of a generation's single-row prefix steps, one per layer, captured once and replayed.

A decode step of a fixed-shape method (whole pages under a fixed budget, a warm device-planned
cache or resident KV) launches the same kernels with the same shapes every token: select, plan,
gather, attend. Launching them one by one from Python costs far more than running them on the
GPU, so after one eager warm-up step per layer the step is captured into a graph over a static
query buffer and replayed per token. Everything a replay produces (output, lse, the step's read
count) lands in static tensors, copied out after each replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.capture import graph_capture

log = logging.getLogger(__name__)

StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""One layer's single-row step: q rows ``[1, Hq, D]`` -> (out ``[1, Hq, D]``, lse ``[1, Hq]``, tokens read)."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    q: torch.Tensor
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    key: object


class StepGraphs:
    """Per-layer CUDA graphs of one generation's single-row steps (on a CUDA device only)."""

    WARM_CALLS = 1
    """Eager calls of a layer's step before it is captured (compiles its kernels, fills caches)."""

    def __init__(self) -> None:
        self._graphs: dict[int, _Captured] = {}
        self._eager_calls: dict[int, int] = {}
        self._pool: tuple[int, int] | None = None
        self.failed = False
        """Set when a capture failed: no further layer is captured (those captured before keep replaying)."""
        self.replays = 0

    def run(self, layer: int, key: object, q: torch.Tensor, step: StepFn
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``step(q)``, from the layer's graph once it has one; ``key`` names what the capture depends on (a
        new key re-captures, e.g. when the generation switched to another page cache)."""
        g = self._graphs.get(layer)
        if g is not None and g.key == key and g.q.shape == q.shape and g.q.dtype == q.dtype:
            g.q.copy_(q)
            g.graph.replay()
            self.replays += 1
            # Copies: the static outputs are overwritten by this layer's next replay, and a caller may keep them.
            return g.out[0].clone(), g.out[1].clone(), g.out[2].clone()
        calls = self._eager_calls.get(layer, 0)
        if self.failed or calls < self.WARM_CALLS:
            self._eager_calls[layer] = calls + 1
            return step(q)
        self._capture(layer, key, q, step)
        return self.run(layer, key, q, step)

    def _capture(self, layer: int, key: object, q: torch.Tensor, step: StepFn) -> None:
        static_q = q.clone()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with graph_capture(graph, q.device, pool=self._pool):
                out = step(static_q)
        except Exception:
            self.failed = True
            log.warning("capturing layer %d's decode step in a CUDA graph failed; this generation runs eagerly",
                        layer, exc_info=True)
            torch.cuda.synchronize()
            raise _CaptureFailed from None
        self._graphs[layer] = _Captured(graph=graph, q=static_q, out=out, key=key)


class _CaptureFailed(Exception):
    """A capture failed (the caller runs the step eagerly)."""


def run_graphed(graphs: StepGraphs, layer: int, key: object, q: torch.Tensor, step: StepFn
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``graphs.run``, falling back to an eager ``step(q)`` when the capture fails."""
    try:
        return graphs.run(layer, key, q, step)
    except _CaptureFailed:
        return step(q)
