"""Layer-ahead prefetch for sparse decode: at layer l, predict layer l+1's selection and prefetch its pages.

While layer l selects, fetches and attends, a background thread of the generation's ``PageFetcher``
reads the predicted pages of layer l+1 that are in neither its GPU page cache nor the host tier from SSD
into the host tier (``PageFetcher.prefetch``), so layer l+1's real fetch finds them there. Predictors
(``OffloadConfig.prefetch``):

- ``speculative``: layer l+1's query approximated from layer l's input hidden state ``h_l`` (the residual
  stream before layer l): ``RoPE(q_proj_{l+1}(input_layernorm_{l+1}(h_l)))`` with layer l's position
  embeddings, then layer l+1's own selector on it. Exact when layer l adds nothing to the residual stream.
  ``h_l`` and the position embeddings come from forward pre-hooks on the model's decoder layers, installed
  for one generation (``installed``) and removed after it; the hooks read, they never change outputs.
- ``same_pages``: layer l's own selection (the same token ids), known after layer l's select.

Models the speculative predictor does not know (``SUPPORTED_MODELS``, or without the submodules it
reads) get no prefetch: ``open_lookahead`` returns None. Every prediction is also scored against the
selection layer l+1 then really makes (``PrefetchCounts`` recall / precision over mid-region pages).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.attention import PREFIX_KWARG
from workers.methods.selector import Selection
from workers.methods.sparse import ROW_ELEMS, SparsePrefixAttention
from workers.offload.config import OffloadConfig
from workers.offload.fetcher import PageFetcher
from workers.offload.stats import PrefetchCounts

SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` whose decoder layers compute the query as ``QueryParts.query`` does."""


@dataclass(frozen=True, eq=False)
class QueryParts:
    """What one decoder layer computes its post-RoPE query from."""

    norm: nn.Module
    """``input_layernorm``."""
    q_proj: nn.Module
    q_norm: nn.Module | None
    """Per-head norm after ``q_proj`` (Qwen3), or None."""
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """The attention module's ``apply_rotary_pos_emb``."""
    head_dim: int
    scaling: float

    def query(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, L, hidden]`` -> the layer's query ``[B, Hq, L, D]`` (as its attention computes it)."""
        q = self.q_proj(self.norm(hidden)).view(*hidden.shape[:-1], -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self.rope(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0]


def query_parts(model: nn.Module) -> list[QueryParts] | None:
    """Per decoder layer, what its query is computed from; None for models this module does not know."""
    if getattr(getattr(model, "config", None), "model_type", None) not in SUPPORTED_MODELS:
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return None
    parts = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        rope = getattr(inspect.getmodule(type(attn)), "apply_rotary_pos_emb", None)
        norm, q_proj = getattr(layer, "input_layernorm", None), getattr(attn, "q_proj", None)
        head_dim, scaling = getattr(attn, "head_dim", None), getattr(attn, "scaling", None)
        if not (callable(rope) and isinstance(norm, nn.Module) and isinstance(q_proj, nn.Module)
                and isinstance(head_dim, int) and isinstance(scaling, float)):
            return None
        parts.append(QueryParts(norm=norm, q_proj=q_proj, q_norm=getattr(attn, "q_norm", None), rope=rope,
                                head_dim=head_dim, scaling=scaling))
    return parts


def page_mask(sel: Selection, n_pages: int, page_size: int) -> torch.Tensor:
    """``[Hkv, n_pages]`` bool: the pages holding a valid selected token of any row of ``sel``."""
    t, h, n = sel.tokens.shape
    mask = torch.zeros(h, n_pages + 1, dtype=torch.bool, device=sel.tokens.device)
    valid = torch.arange(n, device=mask.device) < sel.counts.unsqueeze(-1)
    col = torch.where(valid, torch.div(sel.tokens, page_size, rounding_mode="floor"), n_pages)
    mask.scatter_(1, col.permute(1, 0, 2).reshape(h, -1).long(), True)
    return mask[:, :n_pages]


class Lookahead:
    """Layer-ahead prefetch of one generation (see the module docstring)."""

    def __init__(self, attn: SparsePrefixAttention, fetcher: PageFetcher, mode: str,
                 parts: list[QueryParts] | None = None):
        if mode == "speculative" and parts is None:
            raise ValueError("the speculative predictor needs the model's query parts (query_parts)")
        self.attn, self.fetcher, self.mode, self.parts = attn, fetcher, mode, parts
        self.n_layers = fetcher.layout.n_layers
        self._pred: dict[int, torch.Tensor] = {}
        self._real: dict[int, torch.Tensor] = {}
        self._anchor_pages: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._last = -1
        counts = fetcher.enable_prefetch()
        if counts is None:
            raise ValueError("layer-ahead prefetch needs a host tier to prefetch into")
        self.counts: PrefetchCounts = counts

    # -- hooks -----------------------------------------------------------------------------------
    def install(self, layers: nn.ModuleList) -> None:
        """Hook the decoder layers (speculative) and the sparse attention (both predictors)."""
        self.attn.lookahead = self
        if self.mode == "speculative":
            for i, layer in enumerate(layers):
                self._handles.append(layer.register_forward_pre_hook(functools.partial(self._pre_hook, i),
                                                                     with_kwargs=True))

    def remove(self) -> None:
        """Undo ``install``."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.attn.lookahead = None

    def _pre_hook(self, layer: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before decoder layer ``layer`` of this generation's forward: predict and prefetch layer+1."""
        if kwargs.get(PREFIX_KWARG) is not self.attn:  # another forward (prefill, another generation)
            return
        if layer == 0:
            self.flush()
        pe = kwargs.get("position_embeddings")
        if layer + 1 >= self.n_layers or pe is None or self.parts is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        with self.fetcher.stats.timed("speculate", self.fetcher.device):
            q = self.parts[layer + 1].query(hidden, *pe)
            self._predicted(layer + 1, self._select(layer + 1, q, self.parts[layer + 1].scaling))

    def selected(self, layer: int, sel: Selection) -> None:
        """Called by the sparse path with each real selection of ``layer`` (before its fetch)."""
        if self.mode == "same_pages" and layer < self._last:  # a new forward (no layer hooks in this mode)
            self.flush()
        self._last = layer
        mask = self._mask(sel)
        self._real[layer] = mask | self._real[layer] if layer in self._real else mask
        if self.mode == "same_pages" and layer + 1 < self.n_layers:
            with self.fetcher.stats.timed("speculate", self.fetcher.device):
                self._predicted(layer + 1, mask)

    def flush(self) -> None:
        """Score the predictions of the last forward against the real selections (counters)."""
        sums = [torch.stack([p.sum(), r.sum(), (p & r).sum()]) for layer, p in self._pred.items()
                if (r := self._real.get(layer)) is not None]
        if sums:
            predicted, selected, matched = torch.stack(sums).sum(0).tolist()
            self.counts.predicted_pages += predicted
            self.counts.selected_pages += selected
            self.counts.matched_pages += matched
        self._pred.clear()
        self._real.clear()

    # -- internals -------------------------------------------------------------------------------
    def _mask(self, sel: Selection) -> torch.Tensor:
        return page_mask(sel, self.fetcher.n_pages, self.fetcher.layout.page_size)

    def _select(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Pages ``[Hkv, n_pages]`` layer's selector picks for any row of q ``[B, Hq, L, D]``."""
        ctx = self.attn.layer_context(layer)
        b, hq, l, d = q.shape
        hkv = ctx.kv.n_heads
        rows = q.permute(0, 2, 1, 3).reshape(b * l, hq, d)
        mask = None
        for part in rows.split(max(1, ROW_ELEMS // max(1, hq * ctx.n_tokens))):
            m = self._mask(self.attn.predict(layer, part.view(-1, hkv, hq // hkv, d), scale))
            mask = m if mask is None else mask | m
        assert mask is not None
        return mask

    def _predicted(self, layer: int, mask: torch.Tensor) -> None:
        """Record a prediction of ``layer``'s mid pages and prefetch them with its anchors' pages."""
        self._pred[layer] = mask | self._pred[layer] if layer in self._pred else mask
        want = mask | self._anchors(layer)
        ids = torch.arange(want.shape[1], device=want.device).expand_as(want)
        self.fetcher.prefetch(layer, torch.where(want, ids, -1))

    def _anchors(self, layer: int) -> torch.Tensor:
        if layer not in self._anchor_pages:
            ctx = self.attn.layer_context(layer)
            mask = torch.zeros(ctx.kv.n_heads, self.fetcher.n_pages, dtype=torch.bool, device=ctx.device)
            mask[:, torch.div(ctx.anchors, self.fetcher.layout.page_size, rounding_mode="floor")] = True
            self._anchor_pages[layer] = mask
        return self._anchor_pages[layer]


def open_lookahead(model: nn.Module, attn: object, config: OffloadConfig | None) -> Lookahead | None:
    """The generation's layer-ahead prefetch, or None: prefetch off, not a sparse method over a page fetcher
    with a host tier, a prefix already warm in it (device-planned cache), or a model the speculative
    predictor does not know."""
    if config is None or config.prefetch == "off" or not isinstance(attn, SparsePrefixAttention):
        return None
    source = attn.source
    fetcher = source.fetcher
    if fetcher is None or source.device_cache is not None or fetcher.host is None or fetcher.host.n_slots == 0:
        return None
    parts = query_parts(model) if config.prefetch == "speculative" else None
    if config.prefetch == "speculative" and parts is None:
        return None
    return Lookahead(attn, fetcher, config.prefetch, parts)


@contextlib.contextmanager
def installed(ahead: Lookahead | None, model: nn.Module) -> Iterator[None]:
    """``ahead``'s hooks on ``model`` for the block (nothing when None); removed however the block ends."""
    if ahead is None:
        yield
        return
    layers = getattr(getattr(model, "model", None), "layers", None)
    ahead.install(layers if isinstance(layers, nn.ModuleList) and ahead.mode == "speculative" else nn.ModuleList())
    try:
        yield
    finally:
        ahead.remove()
