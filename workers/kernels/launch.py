"""What every kernel launcher asks before and while launching: is Triton installed, is it interpreting,
block sizes rounded up to a power of two, and whether a tuning config is in range."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (else only the torch references run)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_tuning(config: Any, *, powers_of_two: tuple[str, ...] = (), at_least: int = 1,
                 warps: tuple[int, ...] | None = None, stages: bool = False) -> None:
    """Raise ValueError, naming the field, when a kernel's tuning config is out of range: the ``powers_of_two``
    fields powers of two >= ``at_least``, ``num_warps`` one of ``warps``, ``num_stages`` >= 1 (``stages``)."""
    kind = type(config).__name__
    floor = f" >= {at_least}" if at_least > 1 else ""
    for name in powers_of_two:
        v = getattr(config, name)
        if v < at_least or v & (v - 1):
            raise ValueError(f"{kind}.{name} must be a power of two{floor}, got {v}")
    if warps is not None and config.num_warps not in warps:
        raise ValueError(f"{kind}.num_warps must be one of {warps}, got {config.num_warps}")
    if stages and config.num_stages < 1:
        raise ValueError(f"{kind}.num_stages must be >= 1, got {config.num_stages}")
