"""Gated exponentially decaying memory: ``h_t = g_t ⊙ h_{t-1} + (1 − g_t) ⊙ x_t`` over packed sequences.

``decay_scan`` (launcher: the Triton kernels with autograd, or the torch reference) and the torch
reference ``decay_scan_ref``.
"""

from .ops import DecayScanConfig, decay_scan
from .reference import decay_scan_ref

__all__ = ["DecayScanConfig", "decay_scan", "decay_scan_ref"]
