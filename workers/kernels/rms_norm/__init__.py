"""RMSNorm of every row in one launch.

``rms_norm`` (launcher: Triton on CUDA for bf16/fp16, else the torch reference) and the torch reference
``rms_norm_ref`` (transformers' ``LlamaRMSNorm.forward``, op for op).
"""

from .ops import rms_norm
from .reference import rms_norm_ref

__all__ = ["rms_norm", "rms_norm_ref"]
