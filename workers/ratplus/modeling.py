"""RAT+ modeling: Llama attention whose keys and values pass through a gated decaying memory.

Per layer, before RoPE (as in RAT): ``k̃_t = g_t ⊙ k̃_{t−1} + (1 − g_t) ⊙ k_t`` and the same for v, with an
input-dependent gate ``g_t`` per KV channel (``RatConfig``). RoPE then rotates ``k̃_t`` at position t,
and attention, caches and stores see ``(k̃, ṽ)`` exactly where a Llama has ``(k, v)``.

Continuing the recurrence needs the state before a run of new tokens: with a transformers cache, the
cache's last entry; in the decode engine's packed step, each generation's last own token or, before the
first, the stored prefix's last token (``MEMORY_KWARG``). Stored keys are rotated, so the state is
un-rotated at its own position first.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, LlamaModel, PretrainedConfig
from transformers import initialization as init
from transformers.models.llama import modeling_llama as llama

from workers.kernels.decay_scan import decay_scan
from workers.ratplus.config import RAT_MODEL_TYPE, RatConfig

MEMORY_KWARG = "kvstash_memory"
"""Forward kwarg: a ``MemorySegments`` (the engine's packed step) giving each segment's state to continue."""


class MemorySegments(Protocol):
    """Where each packed generation's tokens start, and the memory state each continues from."""

    def memory_segments(self, layer: int) -> tuple[list[int] | torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bounds ``[0, e_1, ..., T]`` of the packed tokens, k̃ and ṽ ``[S, Hkv, D]`` before each segment's
        first token: k̃ rotated at its own position, as stored; zeros where a segment starts a sequence). The
        bounds may be an int32 tensor on the model's device (a captured step: nothing is copied from the host)."""
        ...


def has_decaying_memory(config: PretrainedConfig) -> bool:
    """Whether a model with this config keeps a decaying memory (its stored K/V are states to continue)."""
    return getattr(config, "model_type", None) == RAT_MODEL_TYPE


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo ``apply_rotary_pos_emb`` on keys ``[..., D]`` rotated with ``cos``, ``sin`` ``[..., D]``."""
    back = k * cos - llama.rotate_half(k) * sin
    return back / (cos * cos + sin * sin)  # 1 for plain RoPE; exact for RoPE types that scale cos and sin


class MemoryGate(nn.Module):
    """``g = (1 − 1/L) σ(W x + b)`` per KV channel (float32); training may scale the cap (``cap_scale``)."""

    def __init__(self, config: RatConfig):
        super().__init__()
        # Own parameters, not an nn.Linear: the generic Linear init must not overwrite the gate's init.
        width = int(config.num_key_value_heads or config.num_attention_heads) * int(config.head_dim or 0)
        self.weight = nn.Parameter(torch.zeros(width, config.hidden_size))
        self.bias = nn.Parameter(torch.full((width,), config.memory_gate_bias))
        self.cap = 1.0 - 1.0 / config.memory_max_length
        self.cap_scale = 1.0
        """Train-time multiplier of the cap (a cap ramp opens the memory from 0, the plain model, to 1); not
        saved: a loaded model always has the full cap."""
        self.record_mean = False
        """Training only: keep ``last_mean``, the mean gate of the last forward at the full cap (with its graph)."""
        self.last_mean: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., hidden]`` -> gates ``[..., Hkv * D]`` in ``[0, cap · cap_scale]``."""
        open_ = torch.sigmoid(nn.functional.linear(x, self.weight, self.bias).float())
        if self.record_mean:  # training with a floor on the memory (lab.train: memory_gate_floor)
            self.last_mean = self.cap * open_.mean()
        return (self.cap * self.cap_scale) * open_


def set_memory_cap_scale(model: nn.Module, scale: float) -> None:
    """Scale every memory gate's cap by ``scale`` in [0, 1] (0: k̃ = k, the plain model; 1: as shipped).
    A model without memory gates is left as it is."""
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"cap scale must be in [0, 1], got {scale}")
    for module in model.modules():
        if isinstance(module, MemoryGate):
            module.cap_scale = float(scale)


def memory_gates(model: nn.Module, *, record_mean: bool = False) -> list[MemoryGate]:
    """Every memory gate of ``model`` in layer order (none for a plain model); with ``record_mean`` each keeps
    the mean of its last forward's gates (``MemoryGate.last_mean``), for a training penalty on them."""
    gates = [m for m in model.modules() if isinstance(m, MemoryGate)]
    for g in gates:
        g.record_mean, g.last_mean = record_mean, None
    return gates


class RatAttention(llama.LlamaAttention):
    """Llama attention over the memory-augmented keys and values."""

    def __init__(self, config: RatConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.memory_gate = MemoryGate(config)
        self.rope = llama.LlamaRotaryEmbedding(config)  # to un-rotate stored states (no stored weights)

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override,unused-ignore]  # kwargs: transformers' and ours
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``LlamaAttention.forward``, with (k̃, ṽ) in place of (k, v)."""
        assert position_embeddings is not None, "RatModel passes the rotary embeddings"
        # transformers >= 5.24 passes the cache as ``cache``; earlier releases as ``past_key_values``
        past_key_values = past_key_values if past_key_values is not None else cache
        b, t = hidden_states.shape[:2]
        hkv, d = self._kv_shape()
        q = self.q_proj(hidden_states).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b * t, hkv, d)
        v = self.v_proj(hidden_states).view(b * t, hkv, d)
        gate = self.memory_gate(hidden_states).view(b * t, hkv, d)
        cu, k0, v0 = self._initial_state(b, t, hidden_states, past_key_values, kwargs)
        k = decay_scan(k, gate, cu, k0.to(k.dtype)).view(b, t, hkv, d).transpose(1, 2)
        v = decay_scan(v, gate, cu, v0.to(v.dtype)).view(b, t, hkv, d).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attend = llama.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                             llama.eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                              self.attention_dropout, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, t, -1).contiguous()), weights

    def _kv_shape(self) -> tuple[int, int]:
        """(KV heads, head dim)."""
        return int(self.config.num_key_value_heads or self.config.num_attention_heads), int(self.head_dim)

    def _initial_state(self, b: int, t: int, x: torch.Tensor, cache: Any,
                       kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Segment bounds of the flattened tokens (int32 on x's device) and each segment's pre-RoPE (k̃, ṽ) state
        ``[S, Hkv, D]``."""
        positions = kwargs.get("position_ids")
        memory: MemorySegments | None = kwargs.get(MEMORY_KWARG)
        if memory is not None:
            if b != 1:
                raise ValueError("a packed step (kvstash_memory) runs one row")
            bounds, k0, v0 = memory.memory_segments(self.layer_idx)
            cu = bounds if isinstance(bounds, torch.Tensor) else torch.tensor(bounds, dtype=torch.int32,
                                                                               device=x.device)
            starts = cu[:-1].long()
            prev = positions[0, starts] - 1 if positions is not None else starts - 1
        else:
            cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=x.device)
            hkv, d = self._kv_shape()
            if cache is None or cache.get_seq_length(self.layer_idx) == 0:
                zeros = x.new_zeros((b, hkv, d))
                return cu, zeros, zeros
            layer = cache.layers[self.layer_idx]
            k0, v0 = layer.keys[:, :, -1], layer.values[:, :, -1]
            prev = (positions[:, 0] if positions is not None
                    else torch.full((b,), cache.get_seq_length(self.layer_idx), device=x.device)) - 1
        cos, sin = self.rope(x, prev.clamp_min(0)[None])  # [1, S, D]
        return cu, unrotate(k0.float(), cos[0, :, None].float(), sin[0, :, None].float()), v0


class RatDecoderLayer(llama.LlamaDecoderLayer):
    """A Llama decoder layer with ``RatAttention``."""

    def __init__(self, config: RatConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = RatAttention(config, layer_idx)


class RatPreTrainedModel(llama.LlamaPreTrainedModel):
    """Weights init: Llama's, with the memory gate at ``W = 0``, ``b = memory_gate_bias``."""

    config_class = RatConfig
    config: RatConfig
    _no_split_modules = ["RatDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MemoryGate):
            init.zeros_(module.weight)
            init.constant_(module.bias, self.config.memory_gate_bias)


class RatModel(RatPreTrainedModel, LlamaModel):
    """``LlamaModel`` with RAT+ layers."""

    def __init__(self, config: RatConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([RatDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.post_init()


class RatForCausalLM(RatPreTrainedModel, LlamaForCausalLM):
    """``LlamaForCausalLM`` with RAT+ layers (``model_type = "kvstash_rat"``)."""

    def __init__(self, config: RatConfig):
        super().__init__(config)
        self.model = RatModel(config)
        self.post_init()


def register_rat() -> None:
    """Register ``RatConfig`` / ``RatForCausalLM`` with the Auto classes (idempotent)."""
    AutoConfig.register(RAT_MODEL_TYPE, RatConfig, exist_ok=True)
    AutoModelForCausalLM.register(RatConfig, RatForCausalLM, exist_ok=True)
