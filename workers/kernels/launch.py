"""What every kernel launcher asks before and while launching: is Triton installed, is it interpreting,
and block sizes rounded up to a power of two."""

from __future__ import annotations

import functools
import importlib.util
import os


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
