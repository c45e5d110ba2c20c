"""Sparse decode attention: one split-K Triton kernel over gathered entries + pseudo-entries.

``sparse_decode_attention`` (launcher, needs triton), ``merge_attention_states``, the
float32 torch path ``sparse_decode_attention_torch`` (devices without the kernel) and the
float64 reference ``sparse_decode_attention_ref`` (plain torch).
"""

from .ops import choose_num_splits, merge_attention_states, sparse_decode_attention
from .reference import sparse_decode_attention_ref
from .torch_ops import sparse_decode_attention_torch

__all__ = [
    "choose_num_splits",
    "merge_attention_states",
    "sparse_decode_attention",
    "sparse_decode_attention_ref",
    "sparse_decode_attention_torch",
]
