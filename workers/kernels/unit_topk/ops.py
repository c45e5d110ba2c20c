"""Public launchers of the unit top-k: validate the call, then run the Triton kernel or the torch reference (its
selection in one C++ call on the CPU where it builds: ``cpu.py``).

``top_units(scores, k)`` and ``group_top_units(logits, k)`` return the ``k`` best unit ids per row in
ascending order, ties to the lower id, with fixed output shapes and no host sync on CUDA (so a
captured decode step can select pages). They replace ``torch.topk`` plus the group softmax on the
decode path: at 8 rows of 8,192 pages ``torch.topk`` runs one block per row and the group softmax
four more kernels. Kernel tuning is an argument, never module state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..launch import check_tuning, next_pow2, triton_available
from .cpu import top_units_cpu, top_units_usable
from .reference import group_mass_ref, top_units_ref

__all__ = ["TopConfig", "group_top_units", "top_units"]

_WARPS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True, kw_only=True)
class TopConfig:
    """Tuning of the Triton kernels (results do not depend on it)."""

    block_units: int = 4096
    """Units a program holds per chunk of a row; a power of two."""
    num_warps: int = 8
    """Warps per program (one program per row)."""
    tile_elements: int = 16384
    """Most logits a program holds at once (a ``[G, units]`` chunk of the mass pass); a power of two."""
    split_units: int = 512
    """Rows longer than this are split over programs of this many units each (``triton_split.py``); a
    power of two, or 0: one program per row always."""
    max_splits: int = 256
    """Most programs per row when split (longer rows take bigger chunks); a power of two."""

    def __post_init__(self) -> None:
        check_tuning(self, powers_of_two=("block_units", "tile_elements"), at_least=16, warps=_WARPS)
        for name in ("split_units", "max_splits"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1) or (name == "max_splits" and v == 0):
                raise ValueError(f"TopConfig.{name} must be a power of two{' or 0' * (name == 'split_units')}, "
                                 f"got {v}")


DEFAULT_TOP = TopConfig()


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return (x.is_cuda and triton_available()) if use_triton is None else use_triton


def _fail(msg: str) -> None:
    raise ValueError(f"unit top-k: {msg}")


def _block(u: int, config: TopConfig) -> int:
    return min(config.block_units, max(16, next_pow2(u)))


def _chunk(u: int, config: TopConfig) -> int:
    """Units per program when a row of ``u`` is split; 0: one program per row."""
    if not config.split_units or u <= config.split_units:
        return 0
    chunk = config.split_units
    while -(-u // chunk) > config.max_splits:
        chunk *= 2
    return chunk


def _split(scores: torch.Tensor | None, logits: torch.Tensor | None, k: int, config: TopConfig) -> torch.Tensor:
    """The split launch: each row over ``C`` programs (``triton_split.py``); scores ``[R, U]`` or logits
    ``[R, G, U]``, last dim contiguous."""
    from .triton_split import (
        _count_kernel,
        _digit_kernel,
        _emit_kernel,
        _lse_parts_kernel,
        _mass_keys_kernel,
        _score_keys_kernel,
    )

    x = scores if scores is not None else logits
    assert x is not None
    r, u, dev = x.shape[0], x.shape[-1], x.device
    chunk = _chunk(u, config)
    c = -(-u // chunk)
    block_c = max(2, next_pow2(c))
    keys = torch.empty((r, u), dtype=torch.int32, device=dev)
    hist = torch.zeros((r, 4, 256), dtype=torch.int32, device=dev)
    counts = torch.empty((r, c, 2), dtype=torch.int32, device=dev)
    out = torch.empty((r, k), dtype=torch.int64, device=dev)
    grid = (r, c)
    w = config.num_warps
    if logits is not None:
        g = logits.shape[1]
        block_g = next_pow2(g)
        parts = torch.empty((r, c, block_g, 2), dtype=torch.float32, device=dev)
        _lse_parts_kernel[grid](logits, parts, u, g, c, logits.stride(0), logits.stride(1), BLOCK_G=block_g,
                                CHUNK=chunk, num_warps=w)
        _mass_keys_kernel[grid](logits, parts, keys, hist, u, g, c, logits.stride(0), logits.stride(1),
                                BLOCK_G=block_g, BLOCK_C=block_c, CHUNK=chunk, num_warps=w)
    else:
        assert scores is not None
        _score_keys_kernel[grid](scores, keys, hist, u, scores.stride(0), CHUNK=chunk, num_warps=w)
    for p in (1, 2, 3):
        _digit_kernel[grid](keys, hist, u, k, PASS=p, CHUNK=chunk, num_warps=w)
    _count_kernel[grid](keys, hist, counts, u, k, c, CHUNK=chunk, num_warps=w)
    _emit_kernel[grid](keys, hist, counts, out, u, k, c, BLOCK_C=block_c, CHUNK=chunk, num_warps=w)
    return out


def _without_kernel(x: torch.Tensor, k: int, use_triton: bool | None, reference: Callable[[], torch.Tensor]
                    ) -> torch.Tensor | None:
    """The result when no kernel needs to run (the reference off CUDA or for an empty result; every id when
    ``k`` covers the row), else None."""
    r, u = x.shape[0], x.shape[-1]
    if not _use_triton(x, use_triton) or k == 0 or r == 0 or x.numel() == 0:
        return reference()
    if k == u:
        return torch.arange(u, device=x.device).expand(r, u).contiguous()
    return None


def _top_off_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``top_units_ref``: on the CPU's C++ kernel where it takes the scores (the same ids), else the torch sorts."""
    return top_units_cpu(scores, k) if top_units_usable(scores) else top_units_ref(scores, k)


def _buffers(r: int, u: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-program kernels' scratch keys ``[R, U]`` and ids ``[R, k]``."""
    return (torch.empty((r, u), dtype=torch.int32, device=device),
            torch.empty((r, k), dtype=torch.int64, device=device))


def top_units(scores: torch.Tensor, k: int, *, use_triton: bool | None = None,
              config: TopConfig = DEFAULT_TOP) -> torch.Tensor:
    """Scores ``[R, U]`` (float, no NaN) -> ``[R, min(k, U)]`` int64 ids of the ``k`` highest, ascending."""
    if scores.dim() != 2 or not scores.dtype.is_floating_point:
        _fail(f"scores must be a float [R, U] tensor, got {scores.dtype} {tuple(scores.shape)}")
    r, u = scores.shape
    k = max(0, min(k, u))
    done = _without_kernel(scores, k, use_triton, lambda: _top_off_triton(scores, k))
    if done is not None:
        return done
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    if _chunk(u, config):
        return _split(scores, None, k, config)
    from .triton import _top_kernel

    keys, out = _buffers(r, u, k, scores.device)
    _top_kernel[(r,)](scores, keys, out, u, k, scores.stride(0), BLOCK_U=_block(u, config),
                      num_warps=config.num_warps)
    return out


def group_top_units(logits: torch.Tensor, k: int, *, use_triton: bool | None = None,
                    config: TopConfig = DEFAULT_TOP) -> torch.Tensor:
    """Logits ``[R, G, U]`` -> ``[R, min(k, U)]`` int64 ids of the ``k`` units with the most group-mean
    softmax mass (``-inf`` logits have mass 0), ascending."""
    if logits.dim() != 3 or not logits.dtype.is_floating_point:
        _fail(f"logits must be a float [R, G, U] tensor, got {logits.dtype} {tuple(logits.shape)}")
    r, g, u = logits.shape
    k = max(0, min(k, u))
    done = _without_kernel(logits, k, use_triton, lambda: _top_off_triton(group_mass_ref(logits), k))
    if done is not None:
        return done
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if _chunk(u, config):
        return _split(None, logits, k, config)
    from .triton import _group_top_kernel

    keys, out = _buffers(r, u, k, logits.device)
    block_g = next_pow2(g)
    block_u = max(16, min(_block(u, config), config.tile_elements // block_g))
    _group_top_kernel[(r,)](logits, keys, out, u, k, g, logits.stride(0), logits.stride(1), BLOCK_G=block_g,
                            BLOCK_U=block_u, num_warps=config.num_warps)
    return out
