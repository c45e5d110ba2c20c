"""One artifact of per-layer tensors (a prefill's summaries), written once as each layer's arrive.

Every layer of a summarizer gives tensors of the same names, dtypes and shapes, so the safetensors header of all
layers is known from the first one: the bytes go straight to the artifact's stream, laid out layer by layer, with
nothing staged in a scratch file and read back at commit. The device-to-host copies go on a side stream
(``store.host_copy``); the digest and the file writes run on a background thread, at most
``MAX_PENDING_SUMMARY_LAYERS`` layers behind the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from store.artifacts import _DTYPE_ORDER, _Entry, _entry, _header, _raw
from store.errors import InvalidInput
from store.host_copy import HostCopy, copy_to_host
from store.writer import ArtifactStream, ClosedOrDiscarded

if TYPE_CHECKING:
    import torch

MAX_PENDING_SUMMARY_LAYERS = 2
"""Layers of one artifact queued for the background writer: bounds the (device) memory their tensors hold, while
the next layer's summaries are computed beside the last one's write."""


class LayerLayout:
    """The layout of an artifact of ``n_layers`` layers of like tensors (``"{layer}.{name}"``), learnt from layer 0:
    checks each next layer and gives the bytes that go before its tensors' (the header, before layer 0's)."""

    def __init__(self, name: str, n_layers: int) -> None:
        self.name, self.n_layers = name, n_layers
        self._entries: dict[str, _Entry] | None = None  # one layer's, by tensor name
        self._order: list[str] = []
        self._next = 0

    def next_layer(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
        """Layer ``layer``'s (the next one's) leading bytes and its tensors in file order; InvalidInput when it is
        out of order or its tensors' names, dtypes or shapes differ from layer 0's."""
        if layer != self._next or layer >= self.n_layers:
            raise InvalidInput(f"artifact {self.name!r}: layer {layer} added; expected layer {self._next} "
                               f"of {self.n_layers}")
        entries = {name: _entry(t) for name, t in tensors.items()}
        header = b""
        if self._entries is None:
            self._entries = entries
            self._order = sorted(entries, key=lambda n: (-_DTYPE_ORDER.index(entries[n].dtype), n))
            names = [f"{ly}.{n}" for ly in range(self.n_layers) for n in self._order]
            header, _ = _header({f"{ly}.{n}": entries[n] for ly in range(self.n_layers) for n in self._order},
                                names)
        elif entries != self._entries:
            raise InvalidInput(f"artifact {self.name!r}: layer {layer}'s tensors {entries} differ from layer 0's "
                               f"{self._entries}")
        self._next += 1
        return header, [tensors[n] for n in self._order]


def layer_artifact_chunks(name: str, n_layers: int, layers: Iterable[Mapping[str, torch.Tensor]]
                          ) -> Iterator[bytes | memoryview]:
    """The bytes of a ``LayerArtifact`` of ``layers`` (each layer's tensors, pulled one layer at a time), as
    chunks for ``KVStore.add_artifact``; InvalidInput when there are not ``n_layers`` of them."""
    layout = LayerLayout(name, n_layers)
    count = 0
    for layer, tensors in enumerate(layers):
        header, held = layout.next_layer(layer, tensors)
        if header:
            yield header
        for t in held:
            yield _raw(t)
        count += 1
    if count != n_layers:
        raise InvalidInput(f"artifact {name!r}: {count} of {n_layers} layers")


class LayerArtifact(ClosedOrDiscarded):
    """Tensors named ``"{layer}.{name}"`` for layers ``0..n_layers-1``, added a layer at a time in order, written
    to ``stream`` as they come; ``close`` waits for the writes and records the artifact, ``discard`` drops it. A
    context manager that closes on success and discards on an exception."""

    def __init__(self, stream: ArtifactStream, n_layers: int, *,
                 max_pending: int = MAX_PENDING_SUMMARY_LAYERS) -> None:
        if n_layers <= 0 or max_pending <= 0:
            raise ValueError("n_layers and max_pending must be positive")
        self.name, self.n_layers = stream.name, n_layers
        self._stream, self._max_pending = stream, max_pending
        self._layout = LayerLayout(stream.name, n_layers)
        self._added = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"artifact-{stream.name}")
        self._pending: deque[Future[None]] = deque()
        self._done = False

    def add(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue layer ``layer``'s tensors (the next layer; the same names, dtypes and shapes as layer 0's); raises
        the error of an earlier layer's write, if one failed."""
        header, held = self._layout.next_layer(layer, tensors)
        self._added += 1
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        # Device tensors start for pinned host memory on a side stream now, after the kernels that made them: a
        # synchronous copy on the writer thread would order the device's next layer behind it.
        copies = [copy_to_host(t) for t in held]
        self._pending.append(self._pool.submit(self._write, header, copies))

    def _write(self, header: bytes, copies: list[HostCopy]) -> None:
        # Runs on the background thread: each tensor's bytes once its copy to the host is done.
        if header:
            self._stream.write(header)
        for c in copies:
            self._stream.write(_raw(c.wait()))
        # Each layer to the disk as it comes when the store fsyncs before the commit: else gigabytes of summaries
        # wait in the page cache for the fsync at close, and the whole prefill waits for them after the forward
        # pass. (A no-op when the store fsyncs after the commit: the stream does not fsync then.)
        self._stream.sync()

    def close(self) -> None:
        """Wait for every layer's write, then finish the artifact (InvalidInput when a layer is missing); once."""
        if self._done:
            return
        try:
            while self._pending:
                self._pending.popleft().result()
            if self._added != self.n_layers:
                raise InvalidInput(f"artifact {self.name!r}: {self._added} of {self.n_layers} layers added")
        except BaseException:
            self.discard()
            raise
        self._pool.shutdown()
        self._done = True
        self._stream.close()

    def discard(self) -> None:
        """Drop the artifact once queued writes have stopped (their errors are dropped with it)."""
        self._done = True
        for job in self._pending:
            job.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._stream.discard()
