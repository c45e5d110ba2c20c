"""A summary artifact used as it arrives: each tensor as soon as its bytes are read, the whole checked later.

Quest's page bounds are written layer by layer (``store.layer_artifact``), so a query's forward can score layer 0
while the later layers are still being read (``store.hashed_read``). Nothing derived from them leaves the worker
before the whole artifact has matched its digest: the generation calls ``verify`` once its query is in, before
its first token goes out (``workers.attention.ObservesQuery``), and fails there when the bytes were not the
recorded ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from store.artifacts import TensorSpan, header_end, safetensors_layout
from store.errors import CorruptData, InvalidInput
from store.kvstore import ArtifactRead


class StreamedArtifact:
    """An artifact's tensors on ``device``, each read-only view handed out once its bytes have arrived (unchecked
    until ``verify``); ``on_verified`` gets the parsed host tensors once the whole matched its digest."""

    def __init__(self, read: ArtifactRead, device: torch.device,
                 on_verified: Callable[[dict[str, torch.Tensor]], None] | None = None):
        self._read: ArtifactRead | None = read
        self._device, self._on_verified = device, on_verified
        self._view: memoryview | None = memoryview(read.buffer)
        read.wait_for(min(8, read.size))
        try:
            read.wait_for(header_end(self._view))
            self._all: dict[str, TensorSpan] = safetensors_layout(self._view)
        except InvalidInput as e:
            self._fail_now(str(e))
        self._spans = dict(self._all)  # those still listed (``pop`` and ``forget`` drop names)
        self._lock = threading.Lock()
        self._verified = False

    def _fail_now(self, why: str) -> None:
        """A header that does not parse: the digest says whether the bytes are damaged or were never valid."""
        assert self._read is not None  # at open, before anything is let go
        self._read.data()  # raises CorruptData when the bytes are not the recorded ones
        raise CorruptData(f"artifact {self._read.name!r}: {why}")

    def __getitem__(self, name: str) -> torch.Tensor:
        span = self._spans[name]  # listed, so the bytes are still held
        assert self._read is not None and self._view is not None
        self._read.wait_for(span.end)
        return span.tensor(self._view).to(self._device, copy=True)

    @property
    def holds_bytes(self) -> bool:
        """Whether it still holds the artifact's host bytes (until verified with every tensor taken)."""
        return self._read is not None

    def pop(self, name: str) -> torch.Tensor:
        """``self[name]``, no longer listed afterwards."""
        value = self[name]
        del self._spans[name]
        self._let_go()
        return value

    def forget(self, names: list[str]) -> None:
        """No longer list ``names`` (without waiting for their bytes)."""
        for name in names:
            self._spans.pop(name, None)
        self._let_go()

    def _let_go(self) -> None:
        """Drop the host bytes once verified and nothing is left to hand out: the owner (a shared state that
        lives as long as its generations) then holds device copies only; the summary cache keeps its own
        reference for as long as it chooses."""
        with self._lock:
            if self._verified and not self._spans:
                self._read = self._view = None

    def __contains__(self, name: object) -> bool:
        return name in self._spans

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._spans))

    def __len__(self) -> int:
        return len(self._spans)

    def verify(self) -> None:
        """Wait for the whole artifact and check it against the manifest (CorruptData otherwise)."""
        with self._lock:
            if self._verified:
                return
            assert self._read is not None  # let go only once verified
            data = self._read.data()
            self._verified = True
        if self._on_verified is not None:
            view = memoryview(data)
            self._on_verified({name: span.tensor(view) for name, span in self._all.items()})
        self._let_go()
