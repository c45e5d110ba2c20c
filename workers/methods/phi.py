"""φ completion (``topk-phi-completion.txt`` §4, appendix C): estimate the unretrieved mid mass.

Prefill stores, per layer and KV head, the max-shifted cache over the mid region M:
``m[f] = max_i log φk(k_i)[f]``, ``u[f] = Σ_i exp(log φk(k_i)[f] - m[f])``,
``T[f] = Σ_i exp(log φk(k_i)[f] - m[f]) v_i``. At each step the retrieved set K is subtracted
with the same shift (one way: ``u_R = u - u_K``, ``T_R = T - T_K``, clamped), and the remainder
R = M \\ K becomes one pseudo-entry with logit ``log Ẑ_R = LSE_f(log φq[f] + m[f] + log u_R[f])``
and value ``N̂_R / Ẑ_R = Σ_f softmax_f(·) T_R[f] / u_R[f]``, normalized together with the exact
entries (one softmax). Everything is computed in the log domain, in float32 or better.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.kernels.phi_term import MlpLayer, cpu_kernel_available, phi_pack, phi_step, phi_term
from workers.kernels.phi_term.stable_cache import (
    U_FLOOR,
    StableCache,
    evaluate,
    feature_sums,
    shifted_sums,
    stable_cache,
    subtract,
)
from workers.methods.base import Summarizer, mid_range
from workers.methods.phi_features import CPU_PHI_FEATURE_BYTES, TokenFeatures
from workers.methods.phi_maps import MAP_KINDS, FavorFeatureMap, FeatureMap, ReZeroMLPFeatureMap
from workers.methods.selector import LayerContext
from workers.methods.source import PrefixSource
from workers.methods.value_index import IndexRemainder
from workers.requests import DecodeConfig

BUILD_CHUNK = 8192
REL_TOL = 64 * torch.finfo(torch.float32).eps
"""The kernel's relative clamp tolerance of the one-way subtraction."""


def build_cache(fmap: FeatureMap, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                chunk: int = BUILD_CHUNK) -> StableCache:
    """The cache of keys/values ``[Hkv, n, D]`` in chunks (two passes: max, then sums), float32."""
    n = k.shape[1]
    if n <= chunk:
        return stable_cache(fmap.log_phi_k(layer, k), v.float())
    m = torch.stack([fmap.log_phi_k(layer, k[:, s:s + chunk]).amax(-2) for s in range(0, n, chunk)]).amax(0)
    m = torch.where(torch.isfinite(m), m, 0.0)
    u = torch.zeros_like(m)
    t = torch.zeros(*m.shape, v.shape[-1], dtype=m.dtype, device=m.device)
    for s in range(0, n, chunk):
        du, dt = shifted_sums(m, fmap.log_phi_k(layer, k[:, s:s + chunk]), v[:, s:s + chunk].float())
        u, t = u + du, t + dt
    return StableCache(m, u, t)


class PhiSummarizer(Summarizer):
    """Prefill: the stable φ cache over the mid region of every layer and KV head (artifact ``phi``)."""

    name = "phi"
    version = 1
    late = True
    phi_dim: int | None = None
    """Feature dimension of the default FAVOR+ map (None: the head dimension, the paper's setting)."""
    seed = 0

    def __init__(self, fmap: FeatureMap | None = None):
        self.fmap = fmap
        """The model's distilled map, when it ships one (else FAVOR+)."""

    def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K, V ``[Hkv, N, D]`` -> ``m``, ``u``, ``t`` and ``meta = [kind, phi_dim, seed, lo, hi]``."""
        d = DecodeConfig()
        lo, hi = mid_range(k.shape[1], d.sink, d.tail)
        fmap = self.feature_map(k.shape[-1])
        c = build_cache(fmap, layer, k[:, lo:hi], v[:, lo:hi])
        meta = torch.tensor([fmap.kind, fmap.phi_dim, fmap.seed, lo, hi], dtype=torch.int64)
        return {"m": c.m, "u": c.u, "t": c.t, "meta": meta}

    def feature_map(self, head_dim: int) -> FeatureMap:
        """The map the cache is built with (decode must use the same one)."""
        if self.fmap is not None:
            return self.fmap
        return FavorFeatureMap(self.phi_dim or head_dim, self.seed)


class Completion(Protocol):
    """What ``SparsePrefixAttention`` asks of a completion term: ``PhiCompletion``, or the indexes' own
    (``value_index.IndexCompletion``)."""

    phi_dim: int
    """Feature dimension the budget plan charges (0: no φ cache fetched)."""
    elem_bytes: int
    remainder: IndexRemainder | None

    def summary_range(self, layer: int) -> tuple[int, int] | None:
        """Tokens its summary covers (None: no limit)."""
        ...

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Load what the layer's steps need."""
        ...

    def reads_pools(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``term`` takes a step's pools with ``rows``."""
        ...

    def term(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k_sel: torch.Tensor,
             v_sel: torch.Tensor, counts: torch.Tensor, *, valid: torch.Tensor | None = None,
             tokens: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The remainder pseudo-entry (``PhiCompletion.term``)."""
        ...


class PhiCompletion:
    """Decode-time φ completion over one stored prefix (the cache is fetched once per generation)."""

    def __init__(self, source: PrefixSource, fmap: FeatureMap | None = None):
        self.tensors = source.artifact(PhiSummarizer.name)
        kind, phi_dim, seed = (int(x) for x in self.tensors["0.meta"][:3])
        if fmap is None and MAP_KINDS.get(kind) != "favor":
            raise ValueError(f"the prefix's φ cache was built with a {MAP_KINDS.get(kind, kind)!r} map; "
                             "pass that feature map to PhiCompletion")
        self.fmap = fmap if fmap is not None else FavorFeatureMap(phi_dim, seed)
        if self.fmap.kind != kind or self.fmap.phi_dim != phi_dim or self.fmap.seed != seed:
            raise ValueError(f"feature map (kind {self.fmap.kind}, dim {self.fmap.phi_dim}, id {self.fmap.seed}) does "
                             f"not match the stored cache (kind {kind}, dim {phi_dim}, id {seed})")
        self.phi_dim = phi_dim
        self.elem_bytes = self.tensors["0.u"].element_size()
        self._caches: dict[int, StableCache] = {}
        self._features: dict[int, TokenFeatures] = {}
        """On the CPU, per layer: the attended tokens' features, mapped once per generation."""
        self._maps: dict[int, tuple[MlpLayer, MlpLayer] | None] = {}
        """Per layer, the distilled map's kernel weights (``kernel_layers``) as this generation's first step without
        autograd found them (the map is not changed while a generation decodes)."""
        self.remainder: IndexRemainder | None = None
        """Where set, the pseudo-entry's value (and optionally its logit) comes from the key and value indexes
        (``value_index.py``) instead of φ's ``N̂_R / Ẑ_R`` (Top-K's default: φ's value is 45-62 % off)."""

    def summary_range(self, layer: int) -> tuple[int, int]:
        """Tokens ``[lo, hi)`` the stored cache covers."""
        meta = self.tensors[f"{layer}.meta"]
        return int(meta[3]), int(meta[4])

    def prepare(self, layer: int, ctx: LayerContext) -> None:
        """Load the layer's cache; subtract cached tokens that this request attends as anchors."""
        t = self.tensors
        cache = StableCache(t[f"{layer}.m"].float(), t[f"{layer}.u"].float(), t[f"{layer}.t"].float())
        lo0, hi0 = self.summary_range(layer)
        extra = torch.cat([torch.arange(lo0, ctx.lo), torch.arange(ctx.hi, hi0)]).to(ctx.device)
        if extra.numel():
            k_x, v_x = ctx.kv.tokens(extra)
            u_k, t_k = shifted_sums(cache.m, self.fmap.log_phi_k(layer, k_x), v_x.float())
            cache = StableCache(cache.m, *subtract(cache, u_k, t_k))
        if ctx.device.type == "cpu":  # the kernel reads them by pointer
            cache = StableCache(cache.m.contiguous(), cache.u.contiguous(), cache.t.contiguous())
        self._caches[layer] = cache
        if ctx.device.type == "cpu" and layer not in self._features:
            feats = TokenFeatures(cache.m, ctx.n_tokens)
            if sum(f.nbytes for f in self._features.values()) + feats.nbytes <= CPU_PHI_FEATURE_BYTES:
                self._features[layer] = feats

    def term(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k_sel: torch.Tensor,
             v_sel: torch.Tensor, counts: torch.Tensor, *, valid: torch.Tensor | None = None,
             tokens: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The remainder pseudo-entry per query head: (logit ``[T, Hkv, G]``, value ``[T, Hkv, G, D]``).

        ``k_sel``, ``v_sel [T, Hkv, n, D]`` (first ``counts [T, Hkv]`` valid, or where ``valid [T, Hkv, n]``)
        are the mid tokens attended exactly; their contributions are subtracted. The logit is ``-inf``
        where nothing remains. ``tokens [T, Hkv, n]``: the entries' token ids, to reuse their features on the CPU.
        ``rows [T, Hkv, n]``: ``k_sel``, ``v_sel`` are a step's pools ``[Hkv, R, D]`` and these the entries' rows
        in them (only where ``reads_pools``). With ``remainder`` set, ``tokens`` is required: the value (and with its
        ``mass="index"`` the logit) is the index estimate over the mid tokens outside them.
        """
        log_z, mean = self._phi(layer, ctx, q, scale, k_sel, v_sel, counts, valid, tokens, rows)
        if self.remainder is None:
            return log_z, mean
        if tokens is None:
            raise ValueError("the index remainder needs the entries' token ids")
        if valid is None:
            valid = torch.arange(tokens.shape[-1], device=tokens.device) < counts.unsqueeze(-1)
        return self.remainder.apply(layer, ctx, q, scale, tokens, valid, log_z, mean)

    def _phi(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k_sel: torch.Tensor,
             v_sel: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor | None, tokens: torch.Tensor | None,
             rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """φ's own pseudo-entry (``term`` without ``remainder``)."""
        if self._kernel_ready(k_sel, v_sel):
            return self._term_kernel(layer, ctx, q, scale, k_sel, v_sel, counts, valid, tokens, rows)
        if rows is not None:
            raise ValueError("rows: only where reads_pools")
        cache = self._caches[layer]
        n = k_sel.shape[2]
        if valid is None:
            valid = torch.arange(n, device=k_sel.device) < counts.unsqueeze(-1)
        else:
            counts = valid.sum(-1)
        feats = self._features.get(layer) if tokens is not None else None
        if feats is not None and tokens is not None:
            w = feats.weights(tokens, valid, k_sel, lambda k: self.fmap.log_phi_k(layer, k))
            sums = feature_sums(w, v_sel.float())
        else:
            lpk = self.fmap.log_phi_k(layer, k_sel).masked_fill(~valid.unsqueeze(-1), float("-inf"))
            sums = shifted_sums(cache.m, lpk, v_sel.float())
        u_r, t_r = subtract(cache, *sums)
        log_z, mean = evaluate(self.fmap.log_phi_q(layer, q, scale), cache.m, u_r, t_r)
        nothing_left = (counts >= ctx.n_mid).unsqueeze(-1)
        return log_z.masked_fill(nothing_left, float("-inf")), mean

    def reads_pools(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``term`` takes a step's pools ``k``, ``v [Hkv, R, D]`` with ``rows`` (no gathered copy)."""
        return self._kernel_ready(k, v)

    def _kernel_ready(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        return (k.is_cpu and k.dtype == torch.float32 and v.dtype == torch.float32
                and k.stride(-1) == 1 and v.stride(-1) == 1 and self.elem_bytes <= 4 and cpu_kernel_available())

    def _kernel_maps(self, layer: int) -> tuple[MlpLayer, MlpLayer] | None:
        """``fmap.kernel_layers(layer)`` (None for other maps), looked up once per layer without autograd."""
        if not isinstance(self.fmap, ReZeroMLPFeatureMap):
            return None
        if torch.is_grad_enabled():
            return self.fmap.kernel_layers(layer)
        if layer not in self._maps:
            self._maps[layer] = self.fmap.kernel_layers(layer)
        return self._maps[layer]

    def _term_kernel(self, layer: int, ctx: LayerContext, q: torch.Tensor, scale: float, k: torch.Tensor,
                     v: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor | None, tokens: torch.Tensor | None,
                     rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``term`` on the CPU kernel (``workers/kernels/phi_term``): the same arithmetic as the torch ops to
        float32 rounding, a handful of calls instead of about 40 ops. With the layer's feature cache, only the
        step's new tokens are mapped (``phi_pack`` packs them for ``fmap.log_phi_k``)."""
        cache = self._caches[layer]
        if rows is not None:
            if rows.dtype != torch.int64 or not rows.is_contiguous():
                rows = rows.long().contiguous()
            shape: tuple[int, int, int] = (rows.shape[0], rows.shape[1], rows.shape[2])
            ks, vs = (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1))
        else:
            shape = (k.shape[0], k.shape[1], k.shape[2])
            ks, vs = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
        n_counts = None
        if valid is not None:  # bool or uint8: the kernel reads bytes
            if not valid.is_contiguous():
                valid = valid.contiguous()
        else:
            n_counts = counts.long().contiguous()
        feats = self._features.get(layer) if tokens is not None else None
        rel_tol = REL_TOL
        maps = self._kernel_maps(layer)
        if feats is not None and tokens is not None and maps is not None and not q.requires_grad:
            # the distilled map's whole step in one call: the bits of the calls below
            if tokens.dtype != torch.int64 or not tokens.is_contiguous():
                tokens = tokens.long().contiguous()
            if q.dtype != torch.float32 or not q.is_contiguous():
                q = q.float().contiguous()
            return phi_step(k, ks, v, vs, rows, valid, n_counts, tokens, feats.w, feats.have, *maps, q, ctx.n_mid,
                            cache.m, cache.u, cache.t, shape=shape, rel_tol=rel_tol, u_floor=U_FLOOR)
        idx = tok = None
        if feats is not None and tokens is not None:
            tok = tokens.long().contiguous()
            idx, packed = phi_pack(k, ks, rows, valid, n_counts, tok, feats.have, shape)
            lp = self.fmap.log_phi_k(layer, packed).contiguous() if packed.shape[2] else None
        else:
            keys = k
            if rows is not None:
                heads = torch.arange(shape[1]).unsqueeze(-1)
                keys = k[heads, rows.clamp_min(0)]
            lp = self.fmap.log_phi_k(layer, keys).float().contiguous()
        lpq = self.fmap.log_phi_q(layer, q, scale).float().contiguous()
        return phi_term(v, vs, rows, valid, n_counts, ctx.n_mid, cache.m, cache.u, cache.t, lpq, lp, shape=shape,
                        idx=idx, tokens=tok, table=feats.w if idx is not None and feats is not None else None,
                        have=feats.have if idx is not None and feats is not None else None,
                        rel_tol=rel_tol, u_floor=U_FLOOR)
