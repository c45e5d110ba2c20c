"""A ``PrefixSource`` over tensors in memory: run any method on given K/V without a store.

For attention-level tests and benchmarks: ``MemorySource.build(kv, summarizers)`` runs the
summarizers exactly as prefill does (artifact keys ``f"{layer}.{key}"``) and serves the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from store.layout import KVLayout, dtype_name
from workers.methods.base import Summarizer
from workers.methods.source import PrefixSource


def summarize_layers(kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     summarizers: Iterable[type[Summarizer] | Summarizer]) -> dict[str, dict[str, torch.Tensor]]:
    """Artifacts of every summarizer (a class, or an instance built with its model's parts) over
    layers ``kv`` (each K, V ``[Hkv, N, D]``)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for cls in summarizers:
        s = cls() if isinstance(cls, type) else cls
        out[s.name] = {f"{layer}.{name}": t for layer, (k, v) in enumerate(kv) for name, t in
                       s.summarize(layer, k, v).items()}
    return out


class MemorySource(PrefixSource):
    """Serves K/V and artifacts held in memory; counts bytes like the store-backed source."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 artifacts: dict[str, dict[str, torch.Tensor]], *, page_size: int = 16):
        k0 = kv[0][0]
        dtype = dtype_name(k0.dtype)
        self._layout = KVLayout(n_layers=len(kv), n_kv_heads=k0.shape[0], head_dim=k0.shape[-1], dtype=dtype,
                                page_size=page_size)
        self._kv, self._artifacts = list(kv), artifacts
        self.device = k0.device
        self.verify = False
        self.fetcher = None
        self.device_cache = None
        self.host_view = None
        self.bytes_read = 0

    @classmethod
    def build(cls, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
              summarizers: Iterable[type[Summarizer] | Summarizer],
              **kwargs: int) -> MemorySource:
        """A source with the artifacts ``summarizers`` produce for ``kv``."""
        return cls(kv, summarize_layers(kv, summarizers), **kwargs)

    def shared_key(self, name: str) -> None:
        """None: in-memory tensors are not shared between generations."""
        return None

    @property
    def layout(self) -> KVLayout:
        """The layout these tensors would be stored with."""
        return self._layout

    @property
    def n_tokens(self) -> int:
        """Tokens in the prefix."""
        return int(self._kv[0][0].shape[1])

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K, V ``[Hkv, N, D]``."""
        k, v = self._kv[layer]
        self.bytes_read += 2 * k.numel() * k.element_size()
        return k, v

    def artifact_streamed(self, name: str) -> dict[str, torch.Tensor]:
        """``artifact``: tensors in memory, nothing to stream in."""
        return self.artifact(name)

    def artifact(self, name: str) -> dict[str, torch.Tensor]:
        """A summarizer's tensors."""
        tensors = self._artifacts[name]
        self.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        return tensors
