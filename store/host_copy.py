"""Device-to-host copies that do not stall the device's stream.

A prefill hands each layer's page bytes and summaries to the store while the next layer's forward pass is queued
behind them. A synchronous copy (``Tensor.cpu()``, or ``copy_`` into pageable memory) makes the caller wait for
every kernel queued so far and leaves the device idle while the bytes move; on the legacy default stream it also
orders every later kernel after it. Here the copy goes on a side stream per device, after the work queued so far
on the caller's stream, into pinned memory: the caller returns at once, the device goes on with the next layer,
and whoever reads the host bytes first waits for the returned event (``HostCopy.wait``, GIL released).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


@dataclass
class HostCopy:
    """A copy into host memory, maybe still in flight."""

    out: torch.Tensor
    """The host tensor the bytes go to."""
    done: torch.cuda.Event | None
    """Recorded after the copy on the side stream (None: the copy was made synchronously)."""

    def wait(self) -> torch.Tensor:
        """``out``, once the copy is complete."""
        if self.done is not None:
            self.done.synchronize()
        return self.out


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def copy_to_host(src: torch.Tensor, out: torch.Tensor | None = None, *,
                 stream: torch.cuda.Stream | None = None) -> HostCopy:
    """Start copying ``src`` into ``out`` (a host tensor of its shape and dtype; default a new pinned one): on a
    side stream (``stream``, default the store's one per device) after the work queued on the current stream when
    ``src`` is on a CUDA device and ``out`` is pinned, else now. ``src``'s memory is kept from reuse until the copy
    is done."""
    import torch

    if src.device.type != "cuda":
        if out is None:
            return HostCopy(out=src.detach(), done=None)
        out.copy_(src)
        return HostCopy(out=out, done=None)
    if out is None:
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    if not out.is_pinned():
        out.copy_(src)  # a copy into pageable memory is synchronous anyway
        return HostCopy(out=out, done=None)
    stream = stream if stream is not None else _side_stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        out.copy_(src.detach(), non_blocking=True)
    src.record_stream(stream)  # the caller may drop src now: the allocator waits for this stream's copy
    done = torch.cuda.Event()
    done.record(stream)
    return HostCopy(out=out, done=done)
