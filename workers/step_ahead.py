"""A stable group's next decode step launched before this step's tokens reach the host.

A decode step ends with a round trip: the device finishes, the host reads the sampled tokens, emits them,
prepares the next step and launches it (for a whole-step CUDA graph of a batch, a launch of ~1,000 nodes).
Meanwhile the device idles. When one captured group is the whole step, the next step needs nothing from the
host: its tokens are this step's picks (the argmax, or the generation's seeded sampler run on the device), already
on the device, and its positions are one further. The engine then launches it first and reads this step's tokens
while it runs (``DecodeEngine`` with ``EngineConfig.step_ahead``).

The next step is a guess that every member goes on. A member whose generation ends at this step (end of
sequence, a stop string, cancelled) leaves the next step's result unused: it wrote one own-KV row past its
end, which nothing reads, and touched its page caches. When any member ends, the whole next step is dropped
once the device has finished it and the following step runs the ordinary way, so what each generation
sees, its tokens and its read counts, is what it would be without stepping ahead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from store.host_copy import copy_to_host
from workers.sampling import Sampler, pick_rows
from workers.step_graph import StaticStep


class DeviceTokens:
    """A step's picks from its logits, made on the device and copied to the host beside later work."""

    def __init__(self, logits: torch.Tensor, samplers: list[Sampler]) -> None:
        """Row ``i``'s token by ``samplers[i]`` (``sampling.pick_rows``: what ``sample_rows`` picks)."""
        self.device = pick_rows(samplers, logits)
        # On a side stream that waits only for the picks: the copy must not queue behind the next step launched on
        # the step's stream after it, nor (a stream of its own) behind a prefill's page copies.
        self._copy = (copy_to_host(self.device, stream=_copy_stream(self.device.device)) if self.device.is_cuda
                      else None)

    def tolist(self) -> list[int]:
        """The token ids (waits for this step only)."""
        if self._copy is None:
            return self.device.tolist()
        return self._copy.wait().tolist()


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


@dataclass(eq=False)
class AheadStep:
    """A launched next step of a static group: whose, its reads, and when the step before it ended."""

    step: StaticStep
    gens: list  # the engine's Generations, in the step's member order
    reads: torch.Tensor | None
    since: float = field(default_factory=time.perf_counter)
    """When the step before it handed out its tokens (its own step time counts from there)."""
    _done: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.step.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    def wait(self) -> None:
        """Until the device has finished the step (before anything it uses may be freed)."""
        if self._done is not None:
            self._done.synchronize()
