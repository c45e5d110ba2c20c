"""The RAT+ model's config: a Llama config plus the decaying memory's two settings."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

RAT_MODEL_TYPE = "kvstash_rat"


@strict
class RatConfig(LlamaConfig):
    """``LlamaConfig`` + the memory ``k̃_t = g_t ⊙ k̃_{t−1} + (1 − g_t) ⊙ k_t`` (same for v) in every layer.

    The gate is ``g = (1 − 1/memory_max_length) · σ(W x + b)`` per KV channel, from the attention
    input ``x``; ``W`` starts at zero and ``b`` at ``memory_gate_bias``.
    """

    model_type = RAT_MODEL_TYPE

    memory_max_length: float = 64.0
    """Longest effective memory length 1 / (1 − g): the gate is capped at 1 − 1/64 (RAT+'s effective length)."""
    memory_gate_bias: float = -3.0
    """Initial gate logit: σ(−3) · (1 − 1/64) ≈ 0.047, so a model converted from plain weights starts with
    k̃ ≈ 0.95 k + 0.05 k̃_{t−1}, close to the plain model (continued training opens the gates)."""

    def validate_architecture(self) -> None:
        """Llama's checks, plus a memory length of at least one token."""
        super().validate_architecture()
        if not self.memory_max_length >= 1.0:
            raise ValueError(f"memory_max_length must be >= 1, got {self.memory_max_length}")
