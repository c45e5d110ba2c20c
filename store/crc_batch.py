"""Verify many pages' keyed CRC32s with one CRC call per chunk of pages instead of one per page.

CRC32 is linear over GF(2). With ``R(r, data)`` the raw register update (zlib's ``crc32`` is
``~R(~init, data)``) and ``S_n(r) = R(r, n zero bytes)`` (a 32x32 bit matrix):

- a page's keyed CRC ``c = crc32(d, seed)`` gives its unkeyed register ``R(0, d) = ~c ^ S_L(~seed)``;
- a chunk ``d_1 .. d_m`` of pages of ``L`` bytes has ``R(0, d_1..d_m) = XOR_i S_L^(m-i)(R(0, d_i))``,
  and ``zlib.crc32(chunk, 0xFFFFFFFF) = ~R(0, chunk)``.

So the stored per-page CRCs give the expected CRC of each chunk (numpy: byte tables per matrix, a
log-depth fold), and one C call over the chunk's bytes (GIL released, so chunks spread over threads)
checks all of its pages. A chunk passes iff its pages' errors cancel in that sum: one corrupt page
never does (``S_L`` is invertible), several do with probability 2^-32, as any single CRC check
misses. A failed chunk is re-checked page by page to name the first bad page. The seeds
(``store.pages.page_crc_seed``: the CRC of ``"{prefix}:{layer}:{head}:{page}"``) are computed
vectorized here too, so no Python runs per page.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

from store.crc32 import crc32

MASK = 0xFFFFFFFF
POLY = 0xEDB88320
"""CRC-32 (zlib's) polynomial, reflected."""


@functools.cache
def _byte_table() -> np.ndarray:
    """The 256-entry table of the byte-at-a-time CRC-32 update."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


def _tables_of(columns: np.ndarray) -> np.ndarray:
    """Byte tables ``[4, 256]`` of the GF(2) linear map whose image of bit ``j`` is ``columns[j]``."""
    v = np.arange(256, dtype=np.uint32)
    out = np.zeros((4, 256), dtype=np.uint32)
    for b in range(4):
        for k in range(8):
            out[b] ^= np.where((v >> k) & 1, columns[8 * b + k], 0).astype(np.uint32)
    return out


def apply_map(tables: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Apply the linear map of ``tables`` (``_tables_of``) to each uint32 of ``x``."""
    x = x.astype(np.uint32, copy=False)
    return (tables[0][x & 0xFF] ^ tables[1][(x >> 8) & 0xFF] ^ tables[2][(x >> 16) & 0xFF]
            ^ tables[3][x >> 24])


@functools.cache
def zero_shift_tables(n_bytes: int, doublings: int = 0) -> np.ndarray:
    """Byte tables of ``S_(n_bytes * 2**doublings)``: the register after that many zero bytes."""
    if doublings == 0:
        zeros = bytes(n_bytes)
        return _tables_of(np.array([zlib.crc32(zeros, ~(1 << j) & MASK) ^ MASK for j in range(32)], dtype=np.uint32))
    half = zero_shift_tables(n_bytes, doublings - 1)
    return _tables_of(apply_map(half, apply_map(half, np.uint32(1) << np.arange(32, dtype=np.uint32))))


def page_seeds(prefix_id: str, layer: int, heads: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """``page_crc_seed(prefix_id, layer, heads[i], pages[i])`` for every i (uint32), without a Python loop."""
    heads = np.asarray(heads, dtype=np.int64)
    pages = np.asarray(pages, dtype=np.int64)
    if pages.size and pages.min() < 0:
        raise ValueError("page ids must be >= 0")
    uniq, inv = np.unique(heads, return_inverse=True)
    base = np.array([zlib.crc32(f"{prefix_id}:{layer}:{h}:".encode()) for h in uniq.tolist()], dtype=np.uint32)
    reg = ~base[inv.reshape(-1)] if uniq.size else np.zeros(0, dtype=np.uint32)
    n_digits = np.ones_like(pages)
    for p in range(1, 19):
        n_digits += pages >= 10**p
    table = _byte_table()
    for j in range(int(n_digits.max()) if pages.size else 0):  # digits, most significant first
        live = n_digits > j
        digit = (pages // 10 ** np.maximum(n_digits - 1 - j, 0)) % 10 + ord("0")
        step = table[(reg ^ digit.astype(np.uint32)) & 0xFF] ^ (reg >> 8)
        reg = np.where(live, step, reg).astype(np.uint32)
    return ~reg


def chunk_pages(page_bytes: int, target_bytes: int) -> int:
    """Pages per chunk: the largest power of two whose pages fit ``target_bytes`` (at least 1)."""
    return 1 << max(0, (max(1, target_bytes // page_bytes)).bit_length() - 1)


def expected_chunk_crcs(want: np.ndarray, seeds: np.ndarray, page_bytes: int, per_chunk: int) -> np.ndarray:
    """``zlib.crc32(chunk, 0xFFFFFFFF)`` each chunk of ``per_chunk`` consecutive pages must give, from the
    pages' keyed CRCs ``want`` and seeds (the last chunk may be short)."""
    n = int(want.shape[0])
    n_chunks = -(-n // per_chunk)
    if n_chunks == 0:
        return np.zeros(0, dtype=np.uint32)
    shift = zero_shift_tables(page_bytes)
    unkeyed = ~want.astype(np.uint32) ^ apply_map(shift, ~seeds.astype(np.uint32))
    # Leading zeros fold to nothing: the short last chunk is padded at its front.
    padded = np.zeros(n_chunks * per_chunk, dtype=np.uint32)
    full = (n_chunks - 1) * per_chunk
    padded[:full] = unkeyed[:full]
    padded[padded.size - (n - full):] = unkeyed[full:]
    x = padded.reshape(n_chunks, per_chunk)
    level = 0
    while x.shape[1] > 1:  # pairs (a, b) -> S_(L * 2^level)(a) ^ b
        x = apply_map(zero_shift_tables(page_bytes, level), x[:, 0::2]) ^ x[:, 1::2]
        level += 1
    return ~x[:, 0]


def chunk_crc(buf: np.ndarray) -> int:
    """CRC-32 of a C-contiguous byte array from the register 0 (compare with ``expected_chunk_crcs``)."""
    return crc32(buf.data.cast("B"), MASK)
