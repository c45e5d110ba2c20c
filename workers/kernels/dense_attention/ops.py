"""Dense attention with log-sum-exp through PyTorch's fused attention kernels.

The flash kernels return the log-sum-exp next to the output (what merging with attention over
other keys needs), so no score matrix is materialized:

- CUDA: ``_scaled_dot_product_flash_attention`` for bf16/fp16 (inputs stay in their dtype);
  ``_scaled_dot_product_efficient_attention`` for fp32 without a mask;
- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (fp32, bf16, fp16; an additive mask for
  offsets other than the top-left causal one).

Where every query row sees every key (the stored prefix, or a decode step over its own cache),
the GQA group is folded into the query rows: one pass over each KV head, never a copy of K/V
per query head. Anything the kernels do not take (empty sets, rows that see nothing, other
devices or dtypes) runs the fp32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import dense_attention_ref

__all__ = ["causal_attention", "dense_attention"]

_FLASH_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_FLASH_HEAD_ALIGN = 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_offset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (out, lse) in fp32; the contract of ``dense_attention_ref``.

    q ``[B, Hq, L, D]``; k, v ``[B, Hkv, S, D]`` (Hq a multiple of Hkv; q is cast to k's dtype).
    With ``q_offset``, query i sees keys ``j <= q_offset + i``; without it every key. Returns out
    ``[B, Hq, L, D]`` and lse ``[B, Hq, L]`` float32.
    """
    b, hq, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if s == 0 or l == 0 or b == 0 or hq % hkv or (q_offset is not None and q_offset < 0):
        return dense_attention_ref(q, k, v, scale, q_offset)
    q = q.to(k.dtype)
    sees_all = q_offset is None or q_offset >= s - 1
    if q.device.type == "cuda":
        res = _cuda(q, k, v, scale, sees_all, q_offset)
    elif q.device.type == "cpu" and q.dtype in _FLASH_CPU_DTYPES and v.dtype == q.dtype:
        res = _cpu(q, k, v, scale, sees_all, q_offset)
    else:
        res = None
    if res is None:
        return dense_attention_ref(q, k, v, scale, q_offset)
    out, lse = res
    return out.float(), lse.float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last L of S positions (query i sees keys ``j <= S - L + i``), in q's dtype.

    q ``[B, Hq, L, D]``; k, v ``[B, Hkv, S, D]`` (L <= S, GQA allowed) -> ``[B, Hq, L, D]``. A chunk of a
    chunked prefill over its cache: on CUDA in bf16/fp16 the flash kernel (its causal mask is aligned
    bottom-right, GQA heads taken as they are), never SDPA's masked fallback; elsewhere SDPA.
    """
    l, s = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda" and _flash_cuda_ok(q) and 0 < l <= s:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    if l == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    allowed = torch.arange(s, device=q.device)[None, :] <= (s - l + torch.arange(l, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def _flash_cuda_ok(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.dtype in _FLASH_CUDA_DTYPES and d <= _FLASH_MAX_HEAD_DIM and d % _FLASH_HEAD_ALIGN == 0


def _fold(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> ``[B, Hkv, G * L, D]``: a group's query rows share their KV head."""
    b, hq, l, d = q.shape
    return q.reshape(b, hkv, (hq // hkv) * l, d)


def _unfold(out: torch.Tensor, lse: torch.Tensor, hq: int, l: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, d = out.shape[0], out.shape[-1]
    return out.reshape(b, hq, l, d), lse[..., : out.shape[2]].reshape(b, hq, l)


def _cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sees_all: bool,
         q_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, l, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if sees_all:
        out, lse = flash(_fold(q, hkv), k, v, 0.0, False, scale=scale)
        return _unfold(out, lse, hq, l)
    assert q_offset is not None
    if q_offset == 0:  # the kernel's own causal mask is aligned top-left
        return flash(q, k, v, 0.0, True, scale=scale)
    allowed = torch.arange(s, device=q.device)[None, :] <= (q_offset + torch.arange(l, device=q.device))[:, None]
    mask = torch.zeros(l, s, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sees_all: bool,
          q_offset: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    b, hq, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if v.dtype != q.dtype:
        return None
    if _flash_cuda_ok(q) and (sees_all or q_offset == s - l):
        qq = _fold(q, hkv) if sees_all else q  # causal rows cannot be folded: flash takes GQA heads itself
        # Flash's causal mask is aligned bottom-right: query i sees keys j <= s - l + i.
        res = torch.ops.aten._scaled_dot_product_flash_attention(qq.contiguous(), k, v, 0.0, not sees_all, False,
                                                                 scale=scale)
        out, lse = res[0], res[1]
        return _unfold(out, lse, hq, l) if sees_all else (out, lse)
    if sees_all and q.dtype == torch.float32:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            _fold(q, hkv).contiguous(), k, v, None, True, 0.0, False, scale=scale)[:2]
        return _unfold(out, lse, hq, l)
    return None
