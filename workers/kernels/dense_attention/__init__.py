"""Dense attention over resident KV that also returns the log-sum-exp (to merge with other partial attentions).

``dense_attention`` (SDPA-class kernels: flash on CUDA, the CPU flash kernel on CPU), its fp32
matmul reference ``dense_attention_ref``, and ``causal_attention`` (a prefill chunk over its cache,
output only).
"""

from .ops import causal_attention, dense_attention
from .reference import dense_attention_ref

__all__ = ["causal_attention", "dense_attention", "dense_attention_ref"]
