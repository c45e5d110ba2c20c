"""The model's small per-layer ops (RoPE, RMSNorm) as one Triton launch each on CUDA.

transformers' Llama computes RoPE as ~10 elementwise launches per layer and each RMSNorm as ~7; at decode
they move a few KB each, so their launches, not their bytes, cost: on the H200 at batch 8 they were about
200 of the ~480 kernels of a captured step's serial part. ``use_fused_ops`` routes a loaded model's Llama
RMSNorm modules and transformers' Llama RoPE function through ``workers.kernels.rms_norm`` and
``workers.kernels.rope``, which launch once on CUDA for bf16/fp16 and keep transformers' own arithmetic
everywhere else (RoPE bit for bit on the GPU as well).

On by default for CUDA models (``load_model(fused_ops=True)``). On the H200 (``bench/bench_model_ops.py``,
8 Llama-3.1-8B-shaped layers, one CUDA graph per step) a step took 0.63x transformers' time at 8 tokens and
0.69x at 1, with logits equal bit for bit; ``tests/test_kernel_rope_rms_norm.py`` checks both kernels there and
in the CPU interpreter. With autograd recording (training) they step aside: the kernels have no backward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from workers.kernels.rms_norm import rms_norm
from workers.kernels.rope import apply_rope

_HF_ROPE = modeling_llama.apply_rotary_pos_emb
"""transformers' own function (what the fused one falls back to)."""


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``, in one launch for CUDA bf16/fp16 heads-first inputs."""
    if unsqueeze_dim != 1 or kwargs or not q.is_cuda or torch.is_grad_enabled():
        return _HF_ROPE(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, **kwargs)
    return apply_rope(q, k, cos, sin)


def _norm_forward(self: modeling_llama.LlamaRMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():  # training: the kernel has no backward
        return modeling_llama.LlamaRMSNorm.forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def use_fused_ops(model: torch.nn.Module) -> int:
    """Route ``model``'s Llama RMSNorm modules and transformers' Llama RoPE through the fused launchers; returns
    how many norms were routed. RoPE is a function of transformers' Llama module, so it is routed for every
    Llama model of the process (bit for bit what transformers computes)."""
    modeling_llama.apply_rotary_pos_emb = _rope
    n = 0
    for mod in model.modules():
        if isinstance(mod, modeling_llama.LlamaRMSNorm):
            mod.forward = types.MethodType(_norm_forward, mod)  # type: ignore[method-assign]
            n += 1
    return n


def use_plain_ops(model: torch.nn.Module) -> None:
    """Undo ``use_fused_ops``: ``model``'s RMSNorms and transformers' Llama RoPE compute as transformers does."""
    modeling_llama.apply_rotary_pos_emb = _HF_ROPE
    for mod in model.modules():
        if isinstance(mod, modeling_llama.LlamaRMSNorm):
            mod.__dict__.pop("forward", None)
