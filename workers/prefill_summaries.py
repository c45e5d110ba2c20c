"""A prefill's per-layer summaries, computed beside its forward pass.

On a CUDA device the summaries (Double-P's k-means, the φ cache, the bounds and indexes) are about a fifth of a
128k prefill's forward pass, and much of that is host time between small kernels (k-means' iterations, the φ
cache's chunks). Run on the forward's stream they add to it; here a background thread computes each layer's
summaries on a stream of its own, after that layer's K/V are final (an event on the forward's stream), while the
forward pass goes on with the next layer. The summaries are the same tensors either way (the same kernels on the
same inputs); only their place in time moves. Elsewhere (the CPU, or ``beside=False``) they are computed inline.

Measured at 128k tokens on an H200 (docs/benchmarks/engine.md): beside won while the store's per-page checksums
held the GIL (25.84 s against 27.74 s inline), and lost once they no longer did (25.64 s against 24.01 s): the
lane's Python (k-means' loop) then takes the GIL from the forward pass's launches. ``Worker`` keeps it off by
default (``summaries_beside``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from store.layer_artifact import LayerArtifact
from store.writer import ClosedOrDiscarded
from workers.methods.base import Summarizer

MAX_LAYERS_AHEAD = 2
"""Layers whose summaries may still be pending when the forward pass hands over the next one: bounds the device
memory their K/V hold (one layer is 512 MiB at 128k tokens with Llama-3.1-8B's KV shape)."""


class SummaryLane(ClosedOrDiscarded):
    """Computes each layer's summaries and adds them to their artifacts, in layer order: on a side CUDA stream from
    a background thread when ``beside`` (and the device is CUDA), else inline in ``add``. A context manager that
    closes on success and discards on an exception."""

    def __init__(self, outs: Sequence[tuple[Summarizer, LayerArtifact]], device: torch.device, *, beside: bool = True,
                 max_ahead: int = MAX_LAYERS_AHEAD) -> None:
        if max_ahead < 1:
            raise ValueError("max_ahead must be >= 1")
        self._outs = list(outs)
        self._max_ahead = max_ahead
        self._pending: deque[Future[None]] = deque()
        self._stream: torch.cuda.Stream | None = None
        self._pool: ThreadPoolExecutor | None = None
        if beside and device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefill-summaries")

    @property
    def beside(self) -> bool:
        """Whether summaries run on the side stream (else inline)."""
        return self._pool is not None

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Summarize layer ``layer``'s final K, V ``[kv_heads, n, head_dim]`` (the next layer in order); raises the
        error of an earlier layer's summaries, if one failed."""
        if self._pool is None:
            self._summarize(layer, k, v)
            return
        ready = torch.cuda.Event()
        ready.record()  # on the forward's stream: K/V of this layer are written once it is reached
        while len(self._pending) >= self._max_ahead:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._beside, layer, k, v, ready))

    def _summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for s, out in self._outs:
            out.add(layer, s.summarize(layer, k, v))

    def _beside(self, layer: int, k: torch.Tensor, v: torch.Tensor, ready: torch.cuda.Event) -> None:
        stream = self._stream
        assert stream is not None
        with torch.inference_mode(), torch.cuda.stream(stream):
            stream.wait_event(ready)
            # K/V were allocated on the forward's stream: their memory must not be reused before this stream's
            # kernels have read them.
            k.record_stream(stream)
            v.record_stream(stream)
            results = [s.summarize(layer, k, v) for s, _ in self._outs]
            # The artifacts' writer threads copy the tensors to the host on their own streams: they must be done.
            stream.synchronize()
        for (_, out), tensors in zip(self._outs, results, strict=True):
            out.add(layer, tensors)

    def close(self) -> None:
        """Wait for every layer's summaries; the first error raises (the artifacts are then discarded by their
        owners)."""
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._shutdown()

    def discard(self) -> None:
        """Stop: queued layers not started are dropped, a running one finishes."""
        for job in self._pending:
            job.cancel()
        self._pending.clear()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
