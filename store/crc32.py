"""The CRC-32 every page checksum uses: zlib's polynomial and semantics, from zlib-ng when it imports.

zlib-ng's ``crc32`` computes exactly ``zlib.crc32`` (same polynomial, same ``value`` chaining) with
carry-less-multiply SIMD, about 10x the system zlib's speed, and releases the GIL on buffers over
5 KiB. Stored checksums do not depend on which one ran.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

crc32: Callable[..., int]
try:
    from zlib_ng.zlib_ng import crc32 as _fast_crc32
except ImportError:  # the stdlib one: same values, slower
    crc32 = zlib.crc32
    CRC32_IMPL = "zlib"
else:
    crc32 = _fast_crc32
    CRC32_IMPL = "zlib-ng"
