"""Rotary position embedding of a layer's queries and keys in one launch.

``apply_rope`` (launcher: Triton on CUDA for bf16/fp16, else the torch reference) and the torch reference
``apply_rope_ref`` (transformers' Llama ``apply_rotary_pos_emb``, op for op).
"""

from .ops import apply_rope
from .reference import apply_rope_ref

__all__ = ["apply_rope", "apply_rope_ref"]
