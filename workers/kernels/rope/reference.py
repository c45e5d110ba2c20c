"""Torch reference of RoPE: transformers' Llama ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, Hq, T, D]``, k ``[B, Hkv, T, D]``, cos, sin ``[B, T, D]`` -> the rotated q, k (each op rounded to the
    inputs' dtype, as transformers computes it)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
