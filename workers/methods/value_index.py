"""The remainder's value for φ completion from the key index's weights and a low-bit value index (issue 14).

φ's estimate of the unread mid tokens' mean value, ``N̂_R / Ẑ_R``, is 45-62 % off on the shipped model while its
pseudo-entry carries about 60 % of the prefix's attention (``lab/notes/phi_diagnosis.md``); a better map does not fix
it (``phi_map_value.md``), and neither do position-block value means (``phi_value_estimators.md``: the remainder's
attention still falls on a few tokens inside each block). What does: the per-token weights Top-K already computes on
its key index (``key_index.py``) applied to every unread token's own value, read from a value index built like the
key index (2 bits per element, per channel over blocks of 64 tokens: ``VALUE_INDEX``):

    v̂_R = Σ_{i∈R} softmax_R(ŝ_i) ṽ_i,    ŝ_i = scale q·k̃_i,    R = mid \\ K (the tokens the step did not read)

and, with ``mass="index"``, the pseudo-entry's logit ``log Σ_{i∈R} exp(ŝ_i)`` instead of φ's ``log Ẑ_R``.

Reads: the value index is an artifact read once per generation (``valueindex``, 7.8 % of the prefix's bf16 K/V at
head_dim 64: ``head_dim / 4`` code bytes + ``head_dim / 16`` bytes of float16 ranges per token and KV head,
``KeyIndexConfig.bytes_per_token``; 14.1 % at 4 bits), charged with the other summaries in
``ReadCounter``'s one-time bytes; nothing is read per step (the key index is Top-K's own). Like the key index it is not
charged in the per-step budget plan (``workers/budget.py`` charges the φ cache, as the paper does): one-time reads
are amortized over the generation's actual steps in the read fraction (``methods/reads.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from workers.methods.base import Summarizer
from workers.methods.key_index import KeyIndexConfig, LayerCache, dequantize_keys, quantize_keys
from workers.methods.selector import LayerContext
from workers.methods.shared_state import shared_by_prefix
from workers.methods.source import PrefixSource

VALUE_INDEX = KeyIndexConfig(bits=2, block=64)
"""How prefill quantizes the values (the key index's scheme: per channel over 64-token blocks, min-max ranges), at 2
bits: 20 bytes a token and KV head at head_dim 64 (7.8 % of the bf16 K/V; 4 bits: 36 bytes, 14.1 %). On the H200, 2
bits gave 4 bits' scores in 10 paired cells (16k: fwe, compare at 40 samples, vt 24, niah_multivalue 16; 8k: fwe,
compare at 40; 1 and 2 %): 7 samples lower and 7 higher in all, the read fraction 5-17 % lower
(docs/benchmarks/accuracy.md, "A 2-bit value index"), at about 4x the output error on the CPU
(``lab/notes/phi_value_estimators.md``). ``bench/bench_vi_bits.py`` runs other widths side by side."""


Mass = Literal["phi", "index"]

Logits = Callable[[int, LayerContext, torch.Tensor, float], torch.Tensor]
"""``(layer, ctx, q [T, Hkv, G, D], scale) -> [T, Hkv, G, n_mid]`` scaled logits of every mid token (float32)."""


class ValueIndexSummarizer(Summarizer):
    """Prefill: every value at ``VALUE_INDEX``'s bits per element (artifact ``valueindex``; ``quantize_keys``'
    layout)."""

    name = "valueindex"
    version = 2  # 2: the 2-bit format, 1: 4-bit (the config's bits and block are in each layer's ``meta``)
    late = True  # only topk+vi reads it, and it is as many bytes as the key index: not worth holding every prefill

    def __init__(self, config: KeyIndexConfig = VALUE_INDEX):
        self.config = config

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """V ``[Hkv, N, D]`` -> ``codes``, ``lo``, ``step``, ``meta`` (as the key index, over the values)."""
        return quantize_keys(v, self.config)


class DecodedValues(LayerCache[torch.Tensor]):
    """Float32 values decoded from the value index, layer by layer on first use (token-major ``[Hkv, N, D]``)."""

    def get(self, layer: int, index: dict[str, torch.Tensor], bits: int, block: int) -> torch.Tensor | None:
        """The layer's decoded values, or None past the cap (``bits``, ``block``: the index's, read once on the host:
        reading them from a device tensor here would sync, which a CUDA graph capture cannot)."""
        codes, lo = index[f"{layer}.codes"], index[f"{layer}.lo"]
        h, n = codes.shape[:2]
        return self._get(layer, h * n * lo.shape[-1] * 4,
                         lambda: dequantize_keys(codes, lo, index[f"{layer}.step"], bits, block))


class SharedValueIndex:
    """A prefix's value index as the generations over it use it (read once, decoded once per layer)."""

    def __init__(self, index: dict[str, torch.Tensor]):
        self.index = index
        self.bits, self.block = (int(x) for x in index["0.meta"][:2])
        self.decoded = DecodedValues()
        self.shared_across_generations = False
        """Whether ``shared_by_prefix`` hands it out."""

    def values(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Float32 values ``[Hkv, hi - lo, D]`` of tokens ``[lo, hi)`` (decoded once per layer, else now)."""
        held = self.decoded.get(layer, self.index, self.bits, self.block)
        if held is not None:
            return held[:, lo:hi]
        i = self.index
        return dequantize_keys(i[f"{layer}.codes"], i[f"{layer}.lo"], i[f"{layer}.step"], self.bits, self.block, lo, hi)


def shared_value_index(source: PrefixSource, artifact: str = ValueIndexSummarizer.name) -> SharedValueIndex:
    """The value index ``artifact`` of ``source``'s prefix (the one another generation holds, else read now)."""
    return shared_by_prefix(source, artifact, SharedValueIndex)


def remainder_mask(ctx: LayerContext, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[T, Hkv, n_mid]``: True for the mid tokens the step did not read (``tokens [T, Hkv, n]`` where ``valid``)."""
    t, hkv, _ = tokens.shape
    ids = torch.where(valid.bool(), tokens.long() - ctx.lo, ctx.n_mid).clamp(0, ctx.n_mid)
    read = torch.zeros(t, hkv, ctx.n_mid + 1, dtype=torch.bool, device=tokens.device)
    read.scatter_(-1, ids, True)
    return ~read[..., :ctx.n_mid]


def remainder_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, remainder: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference: q ``[T, Hkv, G, D]``, the index's keys and values ``[Hkv, n, D]`` of the mid tokens,
    ``remainder [T, Hkv, n]`` -> (``log Σ_R exp(ŝ)`` ``[T, Hkv, G]``, ``Σ_R softmax_R(ŝ) ṽ`` ``[T, Hkv, G, D]``);
    ``-inf`` and zeros where nothing remains."""
    s = torch.einsum("thgd,hnd->thgn", q.double(), keys.double()) * scale
    s = s.masked_fill(~remainder.unsqueeze(2), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.logsumexp(s, -1), torch.einsum("thgn,hnd->thgd", p, values.double())


def merged_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               read_mid: torch.Tensor, lo: int, hi: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference of a whole ``topk+vi`` step of one layer: q ``[1, Hq, T, D]`` over K, V ``[Hkv, N, D]``,
    an exact softmax over the anchors and the mid tokens read (``read_mid [T, Hkv, n_mid]`` of ``[lo, hi)``), plus
    one pseudo-entry of the unread ones from the index ``keys``, ``values`` ``[Hkv, n_mid, D]`` (``remainder_ref``)
    -> (out ``[1, Hq, T, D]``, lse ``[1, Hq, T]``)."""
    _, hq, t, d = q.shape
    hkv, n = k.shape[:2]
    qq = q[0].transpose(0, 1).reshape(t, hkv, hq // hkv, d).double()
    read = torch.ones(t, hkv, n, dtype=torch.bool, device=q.device)
    read[..., lo:hi] = read_mid
    s = (torch.einsum("thgd,hnd->thgn", qq, k.double()) * scale).masked_fill(~read.unsqueeze(2), float("-inf"))
    lz, mean = remainder_ref(qq, keys, values, ~read_mid, scale)
    logits = torch.cat([s, lz.unsqueeze(-1)], -1)
    p = torch.softmax(logits, -1)
    out = torch.einsum("thgn,hnd->thgd", p[..., :n], v.double()) + p[..., n:] * mean
    return (out.reshape(t, hq, d).transpose(0, 1)[None],
            torch.logsumexp(logits, -1).reshape(t, hq).transpose(0, 1)[None])


class IndexRemainder:
    """Decode time: the remainder's value (and with ``mass="index"`` its logit) from the key index's logits and the
    value index (the artifact ``artifact``), over one stored prefix."""

    def __init__(self, source: PrefixSource, logits: Logits, mass: Mass = "phi", *,
                 artifact: str = ValueIndexSummarizer.name):
        if mass not in ("phi", "index"):
            raise ValueError(f"mass must be 'phi' or 'index', got {mass!r}")
        self.values = shared_value_index(source, artifact)
        self.logits, self.mass = logits, mass

    def apply(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, tokens: torch.Tensor,
              valid: torch.Tensor, log_z: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """φ's pseudo-entry ``(log_z [T, Hkv, G], mean [T, Hkv, G, D])`` with the index's value (and mass) of the
        mid tokens outside ``tokens`` (where ``valid``); φ's logit stays ``-inf`` where nothing remains."""
        rem = remainder_mask(ctx, tokens, valid)
        s = self.logits(layer, ctx, q, scale).masked_fill(~rem.unsqueeze(2), float("-inf"))  # [T, Hkv, G, n_mid]
        t, hkv, g, n = s.shape
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - lse).nan_to_num_(0.0)  # -inf - -inf rows: nothing left
        v = self.values.values(layer, ctx.lo, ctx.hi)  # [Hkv, n_mid, D]
        est = torch.bmm(p.transpose(0, 1).reshape(hkv, t * g, n), v).view(hkv, t, g, -1).transpose(0, 1)
        new_z = lse.squeeze(-1) if self.mass == "index" else log_z
        keep = torch.isfinite(log_z)  # φ's own "nothing left" (every mid token read)
        return (torch.where(keep, new_z, log_z).to(log_z.dtype),
                torch.where(keep.unsqueeze(-1), est, mean).to(mean.dtype))


class IndexCompletion:
    """The whole pseudo-entry from the indexes, no φ cache (``topk+phi`` with ``phi_value`` and ``phi_mass``
    ``"index"``): ``PhiCompletion``'s interface for ``SparsePrefixAttention``, with nothing fetched for φ and nothing
    charged for it in the budget plan (``phi_dim`` 0: Top-K's k)."""

    phi_dim = 0
    elem_bytes = 4
    remainder: IndexRemainder | None = None

    def __init__(self, remainder: IndexRemainder):
        if remainder.mass != "index":
            raise ValueError("IndexCompletion takes its mass from the index (mass='index')")
        self.remainder = remainder

    def summary_range(self, layer: int) -> None:
        """No summary of its own narrows the mid region."""
        return None

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Nothing to load per layer (the indexes are read at open)."""

    def reads_pools(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """True: ``term`` reads no K/V rows, only the entries' token ids (no gathered copy)."""
        return True

    def term(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k_sel: torch.Tensor,
             v_sel: torch.Tensor, counts: torch.Tensor, *, valid: torch.Tensor | None = None,
             tokens: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``PhiCompletion.term``'s pseudo-entry (logit ``[T, Hkv, G]``, value ``[T, Hkv, G, D]``) from the indexes
        over the mid tokens outside ``tokens``; ``-inf`` where every mid token was read."""
        if tokens is None:
            raise ValueError("the index completion needs the entries' token ids")
        if valid is None:
            valid = torch.arange(tokens.shape[-1], device=tokens.device) < counts.unsqueeze(-1)
        assert self.remainder is not None
        log_z = q.new_zeros(q.shape[:3], dtype=torch.float32)  # finite: the index's mass replaces it everywhere
        mean = q.new_zeros(q.shape, dtype=torch.float32)
        return self.remainder.apply(layer, ctx, q, scale, tokens, valid, log_z, mean)
