"""Launchers of the CPU φ-term kernel (``kernel.cpp``): ``phi_mlp`` (a distilled map's head-wise MLP on rows),
``phi_pack`` (a step's keys whose features are not cached yet, packed) and ``phi_term`` (features summed with their
values, subtracted from the stable cache, the remainder evaluated). Each is one call in place of the 10-20 torch
ops it replaces; ``reference.py`` holds the torch ops they match to float32 rounding.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .build import load

__all__ = ["MlpLayer", "cpu_kernel_available", "phi_mlp", "phi_pack", "phi_step", "phi_term"]


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return load() is not None


def _lib():  # noqa: ANN202 - the ctypes library
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU φ-term kernel is unavailable (see the log); use the torch ops")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class MlpLayer:
    """One layer's weights of a ``HeadwiseMLP`` for ``phi_mlp``: ``w0 [H, D, E], b0 [H, E], w1 [H, E, E], b1, w2,
    b2, alpha [H], wo [H, E, F], bo [H, F]``, contiguous float32 on the CPU (held, with their pointers)."""

    def __init__(self, weights: Sequence[torch.Tensor]):
        if len(weights) != 9 or any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                                    for w in weights):
            raise ValueError("MlpLayer takes the 9 weights of one layer, contiguous float32 on the CPU")
        self.weights = list(weights)
        self.heads, self.d, self.e = weights[0].shape
        self.f = weights[7].shape[-1]
        self.ptrs = (ctypes.c_void_p * 9)(*(w.data_ptr() for w in weights))


def phi_mlp(layer: MlpLayer, x: torch.Tensor) -> torch.Tensor:
    """Head-wise MLP (``HeadwiseMLP.forward`` of one layer) of rows ``x [..., H, n, D]`` float32 on the CPU ->
    ``[..., H, n, F]`` float32; each row computed alone (the same bits whatever rows come with it)."""
    h, d = layer.heads, layer.d
    *lead, hx, n, dx = x.shape
    if hx != h or dx != d or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"rows {tuple(x.shape)} {x.dtype} on {x.device} do not fit the MLP ({h} heads, D {d})")
    x = x.contiguous()
    out = torch.empty(*lead, h, n, layer.f)
    b = x.numel() // (h * n * d) if n else 0
    _lib().kvstash_phi_mlp(layer.ptrs, d, layer.e, layer.f, x.data_ptr(), b, h, n, out.data_ptr())
    return out


def phi_pack(k: torch.Tensor, strides: tuple[int, int, int], rows: torch.Tensor | None, valid: torch.Tensor | None,
             counts: torch.Tensor | None, tokens: torch.Tensor, have: torch.Tensor, shape: tuple[int, int, int],
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's entries ``[T, H, n]`` (``shape``) valid (``valid``, or ``i < counts [T, H]`` int64) whose token's
    ``have [H, n_tab + 1]`` flag is unset: ``(idx [T, H, n] int32, packed [T, H, W, D])``, ``idx`` their row in
    ``packed`` (-1 for the others), ``packed`` their keys. Key ``(t, h, i)`` is ``k`` (float32, last stride 1) at
    element ``t * st + h * sh + row * sr`` (``strides``) with ``row = max(rows[t, h, i], 0)``, or ``i`` without
    ``rows``. ``tokens [T, H, n]`` int64 (clamped to ``[0, n_tab - 1]``). All index tensors contiguous."""
    t, h, n = shape
    d = k.shape[-1]
    idx = torch.empty(t, h, n, dtype=torch.int32)
    packed = torch.empty(t * h * n * d)
    width = _lib().kvstash_phi_pack(t, h, n, d, k.data_ptr(), *strides, _ptr(rows), _ptr(valid), _ptr(counts),
                                    tokens.data_ptr(), have.data_ptr(), have.shape[1] - 1, idx.data_ptr(),
                                    packed.data_ptr())
    return idx, packed[:t * h * width * d].view(t, h, width, d)


def phi_term(v: torch.Tensor, strides: tuple[int, int, int], rows: torch.Tensor | None, valid: torch.Tensor | None,
             counts: torch.Tensor | None, n_mid: int, m: torch.Tensor, u: torch.Tensor, tc: torch.Tensor,
             log_phi_q: torch.Tensor, lp: torch.Tensor | None, *, shape: tuple[int, int, int],
             idx: torch.Tensor | None = None, tokens: torch.Tensor | None = None, table: torch.Tensor | None = None,
             have: torch.Tensor | None = None, rel_tol: float, u_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_z [T, H, G], mean [T, H, G, D])`` of ``phi.term`` for entries ``[T, H, n]`` (``shape``; values ``v`` read
    as keys are in ``phi_pack``). Features: ``lp [T, H, L, F]`` (log φk) at row ``idx[t, h, i]`` where ``idx`` is given
    and >= 0 (then ``exp(lp - m)`` is also stored in ``table [H, n_tab + 1, F]`` at ``tokens[t, h, i]`` and ``have``
    set), the table where ``idx`` < 0, ``lp`` at row ``i`` without ``idx``. Cache ``m, u [H, F]``, ``tc [H, F, D]``;
    ``log_phi_q [T, H, G, F]``; all float32 contiguous."""
    t, h, n = shape
    g, f = log_phi_q.shape[-2:]
    d = v.shape[-1]
    log_z = torch.empty(t, h, g)
    mean = torch.empty(t, h, g, d)
    n_tab = table.shape[1] - 1 if table is not None else 0
    l_n = lp.shape[2] if lp is not None else 0
    _lib().kvstash_phi_term(t, h, g, n, d, f, n_tab, l_n, n_mid, v.data_ptr(), *strides, _ptr(rows), _ptr(valid),
                            _ptr(counts), _ptr(tokens), _ptr(table), _ptr(have), _ptr(lp), _ptr(idx), m.data_ptr(),
                            u.data_ptr(), tc.data_ptr(), log_phi_q.data_ptr(), ctypes.c_float(rel_tol),
                            ctypes.c_float(u_floor), log_z.data_ptr(), mean.data_ptr())
    return log_z, mean


def phi_step(k: torch.Tensor, ks: tuple[int, int, int], v: torch.Tensor, vs: tuple[int, int, int],
             rows: torch.Tensor | None, valid: torch.Tensor | None, counts: torch.Tensor | None, tokens: torch.Tensor,
             table: torch.Tensor, have: torch.Tensor, kmap: MlpLayer, qmap: MlpLayer, q: torch.Tensor, n_mid: int,
             m: torch.Tensor, u: torch.Tensor, tc: torch.Tensor, *, shape: tuple[int, int, int], rel_tol: float,
             u_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi_pack``, the key map (``kmap``) of the packed keys, the query map (``qmap``, query head ``h * G + g`` of
    ``q [T, H, G, D]`` float32 contiguous) and ``phi_term`` on the table, in one call (the same bits): a distilled
    map's whole per-step term. Arguments as in those."""
    t, h, n = shape
    g, d = q.shape[-2:]
    log_z = torch.empty(t, h, g)  # three empties: cheaper than views of one buffer
    mean = torch.empty(t, h, g, d)
    lpq = torch.empty(t, h, g, qmap.f)
    _lib().kvstash_phi_step(t, h, g, n, d, qmap.f, qmap.e, table.shape[1] - 1, n_mid, k.data_ptr(), *ks,
                            v.data_ptr(), *vs, _ptr(rows), _ptr(valid), _ptr(counts), tokens.data_ptr(),
                            table.data_ptr(), have.data_ptr(), kmap.ptrs, qmap.ptrs, q.data_ptr(), lpq.data_ptr(),
                            m.data_ptr(), u.data_ptr(), tc.data_ptr(), ctypes.c_float(rel_tol),
                            ctypes.c_float(u_floor), log_z.data_ptr(), mean.data_ptr())
    return log_z, mean
