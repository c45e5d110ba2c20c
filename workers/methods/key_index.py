"""A compact approximate key index for Top-K: low-bit keys, quantized per channel over token blocks.

Prefill stores, per layer and KV head, every key at ``bits`` bits per element: for each block of
``block`` consecutive tokens and each channel d, ``lo[d]`` and ``step[d]`` (float16) map code ``c``
to ``lo + step * c``. Keys are quantized per channel, not per token, because post-RoPE keys have
a few large channels that would otherwise set every token's scale. The index is read once per
prefix and device, held on the device and shared by the generations over the prefix
(``shared_key_index``); a step scores every mid token on its codes (``index_logits``) without
touching the exact keys, or on the CPU on keys decoded once from them (``DecodedIndex``), or, for the page
ranking on the CPU, on the codes in a fused kernel (``IndexTiles``, ``workers/kernels/index_page_mass``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from workers.kernels.index_page_mass import CodeTiles
from workers.methods.base import Summarizer
from workers.methods.shared_state import shared_by_prefix
from workers.pages import page_count

if TYPE_CHECKING:
    from workers.methods.source import PrefixSource


PACKED_BITS = (2, 3, 4, 8)
"""Code widths ``pack_codes`` lays out."""
SCORED_BITS = (4, 8)
"""Code widths ``index_logits`` scores from the codes (the key index's; a value index is only decoded)."""


def group_channels(bits: int) -> int:
    """Channels whose codes fill a whole number of bytes at ``bits`` bits each (2 at 4 bits, 4 at 2, 8 at 3)."""
    return 8 // math.gcd(bits, 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each below ``2 ** bits``) -> ``[..., D * bits / 8]`` bytes: channel c's code at bits
    ``[c * bits, (c + 1) * bits)`` of the row, little-endian (at 4 bits: byte j = channel 2j | channel 2j+1 << 4).
    ``D`` must be a multiple of ``group_channels(bits)``."""
    if bits == 8:
        return codes
    g = group_channels(bits)
    nbytes = g * bits // 8
    c = codes.view(*codes.shape[:-1], -1, g).to(torch.int32)
    word = (c << (torch.arange(g, device=c.device, dtype=torch.int32) * bits)).sum(-1, dtype=torch.int32)
    shifts = torch.arange(nbytes, device=c.device, dtype=torch.int32) * 8
    return ((word.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_codes``' inverse: bytes ``[..., D * bits / 8]`` -> uint8 codes ``[..., D]``."""
    if bits == 8:
        return packed
    if bits == 4:  # the key index's layout, on its hot path: no int32 words
        return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    g = group_channels(bits)
    nbytes = g * bits // 8
    b = packed.view(*packed.shape[:-1], -1, nbytes).to(torch.int32)
    word = (b << (torch.arange(nbytes, device=b.device, dtype=torch.int32) * 8)).sum(-1, dtype=torch.int32)
    shifts = torch.arange(g, device=b.device, dtype=torch.int32) * bits
    return ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).flatten(-2)


@dataclass(frozen=True)
class KeyIndexConfig:
    """How keys are quantized for the index."""

    bits: int = 4
    """Bits per element: 2, 3, 4 or 8, packed little-endian along the channels (``pack_codes``). The key index's
    scoring takes 4 or 8 (``index_logits``, ``KeyIndexSummarizer``); the value index is only decoded, at any."""
    block: int = 64
    """Tokens sharing one ``lo``/``step`` pair per channel."""
    clip: bool = False
    """Each block and channel's range: the min-max one (False: every element within half a step), or the one of
    least squared error among ``CLIP_RATIOS`` of it, centered (True: the extreme elements clamped, the rest on a finer
    grid; at 2 bits on the shipped model's values, 0.074 against 0.117 output error, ``lab/notes/
    phi_value_estimators.md``). Only prefill's arithmetic changes: the layout and the decoding are the same."""

    def __post_init__(self) -> None:
        if self.bits not in PACKED_BITS:
            raise ValueError(f"bits must be one of {PACKED_BITS}, got {self.bits}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")

    def bytes_per_token(self, head_dim: int) -> float:
        """Index bytes per token and KV head (codes plus the amortized float16 ``lo``/``step``)."""
        return head_dim * self.bits / 8 + 2 * 2 * head_dim / self.block


KEY_INDEX = KeyIndexConfig()
"""The index prefill builds."""

CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
"""Fractions of a block and channel's min-max half-range a clipped quantizer tries (``KeyIndexConfig.clip``)."""


def quantize_keys(k: torch.Tensor, config: KeyIndexConfig = KEY_INDEX) -> dict[str, torch.Tensor]:
    """K ``[Hkv, N, D]`` -> ``codes`` (uint8 ``[Hkv, N, D * bits / 8]``, ``pack_codes``), ``lo``, ``step`` (float16
    ``[Hkv, blocks, D]``) and ``meta = [bits, block]``."""
    h, n, d = k.shape
    if d % group_channels(config.bits):
        raise ValueError(f"a {config.bits}-bit index needs a head_dim divisible by {group_channels(config.bits)}, "
                         f"got {d}")
    b = config.block
    blocks = page_count(n, b)
    kf = k.float()
    padded = torch.cat([kf, kf[:, -1:].expand(h, blocks * b - n, d)], dim=1).view(h, blocks, b, d)
    levels = (1 << config.bits) - 1
    lo, step = group_ranges(padded, levels, CLIP_RATIOS if config.clip else (1.0,))
    codes = torch.round((padded - lo.float().unsqueeze(2)) / step.float().unsqueeze(2)).clamp(0, levels)
    codes = pack_codes(codes.view(h, blocks * b, d)[:, :n].to(torch.uint8), config.bits)
    return {"codes": codes.contiguous(), "lo": lo, "step": step,
            "meta": torch.tensor([config.bits, b], dtype=torch.int64)}


def group_ranges(x: torch.Tensor, levels: int, ratios: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 ``lo``, ``step`` of ``levels`` uniform steps over the groups along dim 2 of ``x`` (the index's
    ``[Hkv, blocks, block, D]``: per block and channel): each group's min-max range scaled by each of ``ratios``
    about its center, the one of least squared error kept (the first on ties; ``(1.0,)``: min-max)."""
    lo0, hi0 = x.amin(2), x.amax(2)
    best_lo = best_step = best_err = None
    for r in ratios:
        mid, half = (lo0 + hi0) / 2, (hi0 - lo0) / 2 * r
        lo, step = (mid - half).half(), (2 * half / levels).clamp_min(1e-8).half()
        if len(ratios) == 1:
            return lo, step
        lf, sf = lo.float().unsqueeze(2), step.float().unsqueeze(2)
        err = (lf + sf * torch.round((x - lf) / sf).clamp(0, levels) - x).square().sum(2)
        if best_lo is None or best_step is None or best_err is None:
            best_lo, best_step, best_err = lo, step, err
            continue
        better = err < best_err
        best_lo, best_step = torch.where(better, lo, best_lo), torch.where(better, step, best_step)
        best_err = torch.minimum(err, best_err)
    assert best_lo is not None and best_step is not None
    return best_lo, best_step


def dequantize_keys(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, block: int,
                    start: int = 0, end: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The approximate keys ``[Hkv, end - start, D]`` of tokens ``[start, end)`` of an index."""
    c = unpack_codes(codes[:, start:end], bits)
    n = c.shape[1]
    blk = torch.arange(start, start + n, device=c.device) // block
    return lo[:, blk].to(dtype) + step[:, blk].to(dtype) * c.to(dtype)


SCORE_CHUNK_ELEMS = {"cpu": 1 << 20, "cuda": 32 << 20}
"""Elements of unpacked codes (KV heads x tokens x channels) ``index_logits`` handles at a time, per device type:
bounds its temporaries whatever the prefix length (cache-sized on the CPU, where those chunks run fastest: at 16k
tokens of a 2-head, 64-channel index, 2.1 ms against 3.0 ms for 1,024-token chunks; large on a GPU, for few
launches). In elements, not tokens, so a small model's index is not cut into many tiny chunks."""


T = TypeVar("T")

CPU_DECODED_INDEX_BYTES = 512 << 20
"""Bytes of float32 keys a CPU generation may hold decoded from its index (``DecodedIndex``; the same cap bounds the
codes' copy laid out for the page-mass kernel, ``IndexTiles``, an eighth of the decoded keys): on the CPU, unpacking
the codes every step costs about 4.5x a float32 matmul over the decoded keys (at 4k and 16k tokens of a 2-head,
64-channel index: 0.60 / 2.07 ms against 0.13 / 0.62 ms per layer, one thread). 512 MiB holds 16k tokens of 8B-shaped
layers (32 x 8 heads x 128 channels) or the shipped model's whole 32k context; past it, layers score from their
codes. It does not change what is read from the store: the index is read once, as before."""


class LayerCache(Generic[T]):
    """Per-layer values derived from a prefix's index on first use, within ``max_bytes`` (a layer past the cap
    gets None and its caller keeps another path); safe to share between threads."""

    def __init__(self, max_bytes: int = CPU_DECODED_INDEX_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.held: dict[int, T] = {}
        self.nbytes = 0
        self._lock = threading.Lock()

    def _get(self, layer: int, need: int, make: Callable[[], T]) -> T | None:
        """The layer's value, made now (``need`` bytes) unless held, or None past the cap."""
        with self._lock:  # generations sharing it may step on different threads: make each layer's once
            value = self.held.get(layer)
            if value is None:
                if self.nbytes + need > self.max_bytes:
                    return None
                value = self.held[layer] = make()
                self.nbytes += need
            return value


class DecodedIndex(LayerCache[torch.Tensor]):
    """Float32 keys decoded from a prefix's low-bit index, layer by layer as first scored (layers past the cap keep
    scoring from their codes)."""

    @property
    def keys(self) -> dict[int, torch.Tensor]:
        """The decoded layers' keys, by layer."""
        return self.held

    def get(self, layer: int, codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int,
            block: int) -> torch.Tensor | None:
        """The layer's decoded keys ``[Hkv, N, D]`` (channel-major, decoded on first use), or None past the cap."""
        h, n = codes.shape[:2]
        # held channel-major ([Hkv, D, N] in memory, seen as [Hkv, N, D]): the scoring product then reads each
        # channel's tokens contiguously, 2x faster on the CPU than token-major keys, same bits
        return self._get(layer, h * n * lo.shape[-1] * 4,
                         lambda: dequantize_keys(codes, lo, step, bits, block).transpose(1, 2).contiguous()
                         .transpose(1, 2))


class IndexTiles(LayerCache[CodeTiles]):
    """Each layer's index laid out for the page-mass kernel (``CodeTiles``: the codes' own bytes, re-ordered), on
    first use (layers past the cap take the torch path)."""

    @property
    def tiles(self) -> dict[int, CodeTiles]:
        """The laid-out layers, by layer."""
        return self.held

    def get(self, layer: int, codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int,
            block: int) -> CodeTiles | None:
        """The layer's ``CodeTiles`` (laid out on first use), or None past the cap."""
        return self._get(layer, CodeTiles.bytes_for(codes, lo),
                         lambda: CodeTiles.from_index(codes, lo, step, bits, block))


class SharedKeyIndex:
    """A prefix's key index as the generations over it use it: the artifact (read once) and, on the CPU, its keys
    decoded once (``DecodedIndex``, for token-granular scoring) and its codes laid out for the page-mass kernel
    (``IndexTiles``)."""

    def __init__(self, index: dict[str, torch.Tensor]):
        self.index = index
        cpu = index["0.codes"].device.type == "cpu"
        self.decoded = DecodedIndex() if cpu else None
        self.tiles = IndexTiles() if cpu else None
        self.shared_across_generations = False
        """Whether ``shared_key_index`` hands it out (its bytes are then no one generation's own)."""


def shared_key_index(source: PrefixSource) -> SharedKeyIndex:
    """The key index of ``source``'s prefix: the one another generation over it holds (nothing is read then),
    else read now."""
    return shared_by_prefix(source, KeyIndexSummarizer.name, SharedKeyIndex)


def decoded_logits(q: torch.Tensor, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``q . k`` (float32, unscaled) of queries q ``[T, Hkv, G, D]`` against decoded keys ``[Hkv, N, D]`` of
    tokens ``[start, end)``: ``[T, Hkv, G, end - start]``, equal to ``index_logits`` up to float32 rounding."""
    t, h, g, d = q.shape
    rows = q.float().permute(1, 0, 2, 3).reshape(h, t * g, d)
    out = torch.bmm(rows, keys[:, start:end].transpose(1, 2))  # [Hkv, T * G, n]
    return out.view(h, t, g, -1).transpose(0, 1)


def index_logits(q: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, block: int,
                 start: int = 0, end: int | None = None, chunk_tokens: int | None = None) -> torch.Tensor:
    """``q . k`` (float32, unscaled) of queries q ``[T, Hkv, G, D]`` against the index's keys of tokens
    ``[start, end)``, computed from the codes: ``[T, Hkv, G, end - start]``.

    Equal to ``q . dequantize_keys(...)`` up to float32 rounding, without materializing the keys:
    per block, ``q . k = q . lo + (q * step) . codes``.
    """
    if bits not in SCORED_BITS:
        raise ValueError(f"index_logits scores {SCORED_BITS}-bit codes, got bits={bits} (decode others: "
                         "dequantize_keys)")
    h, n = codes.shape[:2]
    end = n if end is None else end
    t, _, g, d = q.shape
    if chunk_tokens is None:
        elems = SCORE_CHUNK_ELEMS.get(q.device.type, SCORE_CHUNK_ELEMS["cpu"])
        chunk_tokens = elems // (h * max(d, t * g))  # the codes and the rows' logits both scale with it
    chunk = chunk_tokens
    qf = q.float().permute(1, 0, 2, 3).reshape(h, t * g, d)  # [Hkv, R, D], R = T * G rows per KV head
    order = torch.arange(d, device=q.device)
    if bits == 4:  # the codes unpack as [low nibbles (even channels), high nibbles (odd ones)]
        order = torch.cat([order[0::2], order[1::2]])
    q_codes = qf[..., order]
    out = torch.empty(t, h, g, end - start, device=q.device)
    chunk_blocks = max(1, chunk // block)
    last = -(-end // block)
    for b0 in range(start // block, last, chunk_blocks):
        b1 = min(b0 + chunk_blocks, last)
        q_lo = torch.einsum("hrd,hbd->hbr", qf, lo[:, b0:b1].float())  # a constant per block and row
        w = q_codes[:, None] * step[:, b0:b1, None][..., order].float()  # [Hkv, nb, R, D]: the codes' weights
        c = codes[:, b0 * block:min(b1 * block, n)]
        pad = (b1 - b0) * block - c.shape[1]  # the prefix's last block may be partial
        if pad:
            c = torch.cat([c, c.new_zeros(h, pad, c.shape[2])], 1)
        c = c.view(h, b1 - b0, block, -1)
        if bits == 4:
            c = torch.cat([c & 0xF, c >> 4], -1)
        part = w @ c.float().transpose(-1, -2) + q_lo[..., None]  # [Hkv, nb, R, block]
        part = part.permute(0, 2, 1, 3).reshape(h, t, g, -1)  # [Hkv, T, G, tokens from b0 * block]
        a, z = max(start, b0 * block), min(end, b1 * block)
        out[..., a - start:z - start] = part[..., a - b0 * block:z - b0 * block].transpose(0, 1)
    return out


class KeyIndexSummarizer(Summarizer):
    """Prefill: the low-bit key index of each layer (artifact ``keyindex``)."""

    name = "keyindex"
    version = 1

    def __init__(self, config: KeyIndexConfig = KEY_INDEX):
        if config.bits not in SCORED_BITS:
            raise ValueError(f"the key index is scored at {SCORED_BITS} bits (index_logits), got {config.bits}")
        self.config = config

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K ``[Hkv, N, D]`` -> the quantized keys (``quantize_keys``)."""
        return quantize_keys(k, self.config)
