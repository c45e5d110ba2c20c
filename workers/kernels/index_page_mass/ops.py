"""Launcher of the CPU page-mass kernel (``kernel.cpp``) and the layout of the codes it reads.

``index_page_mass`` gives what Top-K's page ranking needs, ``page_mass_ref(scale * q . k)`` over the index's keys
``k = lo + step * code``, without decoding the keys or writing a logit: at 4k tokens of the shipped model a
layer's decoded float32 keys are 2 MB that each step reads from memory, its 4-bit codes 256 KB.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .build import load

__all__ = ["DEFAULT_PAGE_MASS", "LANES", "CodeTiles", "IndexPageMassConfig", "cpu_kernel_available",
           "cpu_kernel_preferred", "index_page_mass"]

LANES = 16
"""Tokens per tile of ``CodeTiles`` (the kernel's vector width in tokens; fixed in ``kernel.cpp``)."""


@dataclass(frozen=True, kw_only=True)
class IndexPageMassConfig:
    """Threading of the kernel (results do not depend on it: each KV head is computed alone)."""

    parallel_macs: int = 1 << 24
    """Multiply-adds (rows x tokens x channels) from which a call splits its KV heads over threads: starting
    threads costs tens of microseconds, a call of 2^24 takes about half a millisecond on one core (the shipped
    model's 16k tokens: 2^23, one thread; Llama-3.1-8B's 32k: 2^27)."""
    threads: int | None = None
    """Most threads a large call uses; None: ``torch.get_num_threads()`` (the caller's intra-op setting)."""

    def __post_init__(self) -> None:
        if self.parallel_macs < 0 or (self.threads is not None and self.threads < 1):
            raise ValueError(f"bad IndexPageMassConfig {self}")


DEFAULT_PAGE_MASS = IndexPageMassConfig()


def cpu_kernel_available() -> bool:
    """Whether the kernel is built and loaded (built on the first call; False, logged once, without a compiler)."""
    return load() is not None


def cpu_kernel_preferred() -> bool:
    """Whether Top-K should score on the kernel: built, with its AVX-512 paths (elsewhere it is no faster than the
    torch path, and Top-K keeps that; logged once)."""
    loaded = load()
    return loaded is not None and loaded.avx512


@dataclass(frozen=True)
class CodeTiles:
    """A layer's key index laid out for the kernel: codes ``[Hkv, tiles, bytes, 16]`` uint8 (each code byte of 16
    consecutive tokens contiguous, so the kernel loads a tile's channel as one vector; the last tile zero-padded),
    ``lo`` and ``step`` float32 ``[Hkv, blocks, D]``."""

    codes: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    bits: int
    block: int
    tokens: int

    @staticmethod
    def from_index(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, block: int) -> CodeTiles:
        """Re-lay a ``quantize_keys`` index (codes ``[Hkv, N, bytes]``, float16 ``lo``/``step``); a copy of the
        codes' bytes, once per layer."""
        h, n, nb = codes.shape
        tiles = -(-n // LANES)
        padded = torch.zeros(h, tiles * LANES, nb, dtype=torch.uint8)
        padded[:, :n] = codes
        laid = padded.view(h, tiles, LANES, nb).transpose(2, 3).contiguous()
        return CodeTiles(laid, lo.float().contiguous(), step.float().contiguous(), bits, block, n)

    @staticmethod
    def bytes_for(codes: torch.Tensor, lo: torch.Tensor) -> int:
        """What ``from_index`` of this index would hold, without laying it out."""
        h, n, nb = codes.shape
        return h * -(-n // LANES) * LANES * nb + 2 * lo.numel() * 4

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lo, self.step))


def index_page_mass(q: torch.Tensor, tiles: CodeTiles, scale: float, start: int, end: int, page: int, *,
                    config: IndexPageMassConfig = DEFAULT_PAGE_MASS) -> torch.Tensor:
    """Each KV head's group-mean softmax mass of ``scale * q . k`` over the index's tokens ``[start, end)``,
    summed per page: ``[T, Hkv, pages]`` float32 (pages ``start // page`` to ``ceil(end / page)``), as
    ``page_mass_ref`` gives on the same logits up to float32 rounding. ``q``: ``[T, Hkv, G, D]`` on the CPU."""
    loaded = load()
    if loaded is None:
        raise RuntimeError("the CPU index page-mass kernel is unavailable (see the log); use page_mass_ref")
    fn = loaded.fn
    t, h, g, d = q.shape
    hk, n_tiles, nb, _ = tiles.codes.shape
    if q.device.type != "cpu" or h != hk or nb * 8 // tiles.bits != d:
        raise ValueError(f"q {tuple(q.shape)} on {q.device} does not match tiles of {hk} heads, {nb} bytes")
    if not 0 <= start < end <= tiles.tokens or page < 1:
        raise ValueError(f"bad range [{start}, {end}) of {tiles.tokens} tokens, page {page}")
    p0, p1 = start // page, -(-end // page)
    rows = q.detach().float().permute(1, 0, 2, 3).contiguous()  # [Hkv, T, G, D]: rows r = t * G + g per head
    out = torch.zeros(t, h, p1 - p0)
    blocks = tiles.lo.shape[1]
    threads = 1
    if t * g * (end - start) * d * h >= config.parallel_macs:
        threads = config.threads if config.threads is not None else torch.get_num_threads()
    rc = fn(tiles.codes.data_ptr(), tiles.lo.data_ptr(), tiles.step.data_ptr(), rows.data_ptr(), out.data_ptr(),
            h, n_tiles, d, tiles.bits, tiles.block, blocks, t * g, g, start, end, page, p0, p1 - p0,
            ctypes.c_float(scale), threads)
    if rc:
        raise ValueError(f"the CPU index page-mass kernel refused bits={tiles.bits}")
    return out
