"""Positive feature maps φq, φk for φ completion (``topk-phi-completion.txt`` §3.2, appendix J).

A map turns post-RoPE queries and keys into positive features whose inner product stands in
for the unnormalized softmax kernel: ``<φq(q), φk(k)> ≈ exp(scale * q . k)``. Maps work in the
log domain (``log φ``), which the stable cache (appendix C) needs anyway.

- ``FavorFeatureMap``: training-free positive orthogonal random features (FAVOR+, Choromanski
  et al. 2021), seeded per (layer, KV head); the default until distilled maps exist.
- ``ReZeroMLPFeatureMap``: the paper's head-wise one-block ReZero-MLP (appendix J), φq per query
  head and φk per KV head; ``load_feature_map`` reads one distilled by ``lab.train.phi_distill``
  from a model folder.

Shapes: keys ``[..., Hkv, n, D] -> [..., Hkv, n, F]``; queries grouped by KV head
``[..., Hkv, G, D] -> [..., Hkv, G, F]`` (query head ``h * G + g`` reads KV head ``h``).
"""

from __future__ import annotations

import abc
import functools
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from workers.fingerprint import tensors_digest
from workers.kernels.phi_term import MlpLayer, cpu_kernel_available, phi_mlp

MAP_KINDS: dict[int, str] = {1: "favor", 2: "rezero_mlp"}
OMEGA_CACHE_LAYERS = 256
"""Layers' FAVOR+ projections kept per process (``favor_omega``): float32 ``[Hkv, F, D]``, 512 KiB each at 8 KV
heads and F = D = 128."""
MAP_WEIGHTS = "phi_map.safetensors"
MAP_CONFIG = "phi_map.json"
"""A distilled map ships next to the model's weights under these names (``lab.train.phi_distill``)."""


class FeatureMap(nn.Module, abc.ABC):
    """Head-wise positive feature maps in the log domain."""

    kind: ClassVar[int]
    phi_dim: int

    @abc.abstractmethod
    def log_phi_k(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``log φk``: keys ``[..., Hkv, n, D]`` -> ``[..., Hkv, n, F]`` float32."""

    @abc.abstractmethod
    def log_phi_q(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``log φq``: queries ``[..., Hkv, G, D]`` (logit scale ``scale``) -> ``[..., Hkv, G, F]`` float32."""

    @property
    def seed(self) -> int:
        """Identity stored with a φ cache: a random map's seed, a learned map's weight digest."""
        return 0


def orthogonal_gaussian(n_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """``[n_rows, dim]`` Gaussian rows, orthogonal within each block of ``dim`` (Performer ORF), float64."""
    blocks = []
    for _ in range(-(-n_rows // dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))  # Householder QR folds directions; this makes Q Haar-uniform
        norms = torch.randn(dim, dim, generator=generator, dtype=torch.float64).norm(dim=1)
        blocks.append(q.T * norms[:, None])
    return torch.cat(blocks)[:n_rows]


@functools.lru_cache(maxsize=OMEGA_CACHE_LAYERS)
def favor_omega(seed: int, layer: int, kv_heads: int, dim: int, phi_dim: int) -> torch.Tensor:
    """The FAVOR+ projections ``[Hkv, F, D]`` float32 (host) of one layer, drawn from ``(seed, layer, kv_head)``.

    Cached per process: every prefill builds a new map, and the QR factorizations on the host cost more than the
    φ cache itself on a GPU (and far more while the store's threads keep the host's cores busy)."""
    rows = []
    for h in range(kv_heads):
        g = torch.Generator().manual_seed((seed * 1_000_003 + layer) * 4099 + h)
        rows.append(orthogonal_gaussian(phi_dim, dim, g))
    return torch.stack(rows).float()


class FavorFeatureMap(FeatureMap):
    """FAVOR+ positive random features: ``E[<φq(q), φk(k)>] = exp(scale q . k)`` (unbiased).

    ``log φ(x)[f] = ω_f . x' - |x'|^2 / 2 - log(F) / 2`` with ``k' = k d^{-1/4}`` and
    ``q' = scale d^{1/4} q`` (the logit scale lives on the query side, so the key-side cache
    built at prefill does not depend on it). ``ω`` is orthogonal Gaussian, drawn from
    ``(seed, layer, kv_head)``: the same map at prefill and at decode, on any device.
    """

    kind = 1

    def __init__(self, phi_dim: int, seed: int = 0):
        super().__init__()
        if phi_dim <= 0:
            raise ValueError(f"phi_dim must be positive, got {phi_dim}")
        self.phi_dim, self._seed = phi_dim, seed
        self._omega: dict[tuple[int, int, int, str], torch.Tensor] = {}

    @property
    def seed(self) -> int:
        """The random-feature seed."""
        return self._seed

    def omega(self, layer: int, kv_heads: int, dim: int, device: torch.device) -> torch.Tensor:
        """Projections ``[Hkv, F, D]`` float32 of one layer (cached per device)."""
        key = (layer, kv_heads, dim, str(device))
        if key not in self._omega:
            # a copy: the process-wide cached tensor is never handed out to be modified
            self._omega[key] = favor_omega(self._seed, layer, kv_heads, dim, self.phi_dim).to(device, copy=True)
        return self._omega[key]

    def _log_features(self, layer: int, x: torch.Tensor, mult: float) -> torch.Tensor:
        xs = x.float() * mult
        w = self.omega(layer, x.shape[-3], x.shape[-1], x.device)
        proj = torch.matmul(xs, w.transpose(-1, -2))  # [..., H, n, F]
        return proj - 0.5 * xs.square().sum(-1, keepdim=True) - 0.5 * math.log(self.phi_dim)

    def log_phi_k(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``log φk`` of keys ``[..., Hkv, n, D]``."""
        return self._log_features(layer, k, k.shape[-1] ** -0.25)

    def log_phi_q(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``log φq`` of grouped queries ``[..., Hkv, G, D]``."""
        return self._log_features(layer, q, scale * q.shape[-1] ** 0.25)


_MLP_PARAMS = ("w0", "b0", "w1", "b1", "w2", "b2", "alpha", "wo", "bo")


class HeadwiseMLP(nn.Module):
    """One ReZero-MLP per (layer, head): stem, gated GELU block, output (appendix J).

    ``g0 = W0 x + b0``; ``g1 = g0 + α (W2 GELU(W1 g0 + b1) + b2)``; ``log φ(x) = Wo g1 + bo``
    (so ``φ = exp(·)`` is positive). ``α`` starts at 0 (ReZero).
    """

    def __init__(self, n_layers: int, n_heads: int, d_in: int, hidden: int, d_out: int, *, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(n_layers, n_heads, *shape, generator=g) / math.sqrt(shape[0]))

        self.w0, self.b0 = weight(d_in, hidden), nn.Parameter(torch.zeros(n_layers, n_heads, hidden))
        self.w1, self.b1 = weight(hidden, hidden), nn.Parameter(torch.zeros(n_layers, n_heads, hidden))
        self.w2, self.b2 = weight(hidden, hidden), nn.Parameter(torch.zeros(n_layers, n_heads, hidden))
        self.alpha = nn.Parameter(torch.zeros(n_layers, n_heads))
        self.wo, self.bo = weight(hidden, d_out), nn.Parameter(torch.zeros(n_layers, n_heads, d_out))
        self._kernel_layers: dict[int, MlpLayer | None] = {}
        """Per layer, the parameters' views the CPU kernel reads (None: it cannot)."""

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[..., H, n, d_in] -> [..., H, n, d_out]`` with head ``h``'s own weights (``kernel_forward`` where it
        applies)."""
        out = self.kernel_forward(layer, x)
        if out is not None:
            return out
        x = x.float()
        # matmul broadcasts each head's [d, e] weight over the leading dims: the einsum's product, 1.2-1.9x faster
        # on the CPU at decode sizes (a per-step cost of φ completion)
        g0 = torch.matmul(x, self.w0[layer]) + self.b0[layer][:, None]
        a = F.gelu(torch.matmul(g0, self.w1[layer]) + self.b1[layer][:, None])
        delta = torch.matmul(a, self.w2[layer]) + self.b2[layer][:, None]
        g1 = g0 + self.alpha[layer][:, None, None] * delta
        return torch.matmul(g1, self.wo[layer]) + self.bo[layer][:, None]

    def kernel_forward(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """``forward`` on the CPU without autograd (decode, prefill): one call of the C++ kernel
        (``workers/kernels/phi_term``: the same arithmetic to float32 rounding, each row alone) instead of about 20
        torch ops; None where it does not apply (another device or dtype, autograd, no compiler)."""
        if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or self.w0.requires_grad)):
            return None
        weights = self.kernel_layer(layer)
        return phi_mlp(weights, x.float()) if weights is not None else None

    def kernel_layer(self, layer: int) -> MlpLayer | None:
        """The layer's weights as the CPU kernel reads them (cached), or None where it cannot run."""
        if layer not in self._kernel_layers:
            self._kernel_layers[layer] = self._layer_weights(layer)
        return self._kernel_layers[layer]

    def _layer_weights(self, layer: int) -> MlpLayer | None:
        """The layer's weights for the CPU kernel (views of the parameters), or None where it cannot run."""
        params = [getattr(self, name) for name in _MLP_PARAMS]
        if not all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in params):
            return None
        return MlpLayer([p.detach()[layer] for p in params]) if cpu_kernel_available() else None

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """``.to()``, ``.float()`` and the like may move the parameters: the kernel's views are taken again."""
        self._kernel_layers.clear()
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        """Copies and pickles carry no kernel views (they hold raw pointers)."""
        return {**self.__dict__, "_kernel_layers": {}}

    def __setattr__(self, name: str, value: Any) -> None:  # noqa: ANN401 - nn.Module's signature
        """A replaced parameter: the kernel's views are taken again (a parameter's ``.data`` replaced in place
        is not seen)."""
        if name in _MLP_PARAMS and "_kernel_layers" in self.__dict__:
            self._kernel_layers.clear()
        super().__setattr__(name, value)


class ReZeroMLPFeatureMap(FeatureMap):
    """The paper's asymmetric head-wise maps: φq per (layer, query head), φk per (layer, KV head).

    Untrained it is just a positive map; load distilled weights with ``load_state_dict``. The
    logit scale is baked into distilled weights, so ``log_phi_q`` ignores ``scale``.
    """

    kind = 2

    def __init__(self, *, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, phi_dim: int,
                 hidden: int | None = None, seed: int = 0):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        hidden = hidden or head_dim
        self.phi_dim, self.n_heads, self.n_kv_heads = phi_dim, n_heads, n_kv_heads
        self.shape = (n_layers, n_heads, n_kv_heads, head_dim)
        """(layers, query heads, KV heads, head dim) of the model it maps."""
        self.q = HeadwiseMLP(n_layers, n_heads, head_dim, hidden, phi_dim, seed=seed)
        self.k = HeadwiseMLP(n_layers, n_kv_heads, head_dim, hidden, phi_dim, seed=seed + 1)
        self.digest = 0

    @property
    def seed(self) -> int:
        """Digest of the loaded weights (0 until `load_feature_map` sets it), so a cache built with
        other weights is refused."""
        return self.digest

    def kernel_layers(self, layer: int) -> tuple[MlpLayer, MlpLayer] | None:
        """The layer's (key, query) weights for the CPU kernel's whole step (``phi_term.phi_step``), or None where
        ``log_phi_k`` / ``log_phi_q`` would not run the kernel (autograd, another device or dtype, no compiler) or
        are not this class's own (overridden or replaced on the instance)."""
        cls = ReZeroMLPFeatureMap
        if (type(self).log_phi_k is not cls.log_phi_k or type(self).log_phi_q is not cls.log_phi_q
                or "log_phi_k" in self.__dict__ or "log_phi_q" in self.__dict__):
            return None
        if torch.is_grad_enabled() and self.k.w0.requires_grad:
            return None
        kl, ql = self.k.kernel_layer(layer), self.q.kernel_layer(layer)
        return (kl, ql) if kl is not None and ql is not None else None

    def log_phi_k(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``log φk`` of keys ``[..., Hkv, n, D]``."""
        out = self.k.kernel_forward(layer, k)  # the CPU kernel, without the module call's overhead
        return out if out is not None else self.k(layer, k)

    def log_phi_q(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``log φq`` of grouped queries ``[..., Hkv, G, D]`` (one MLP per query head)."""
        *lead, hkv, g, d = q.shape
        rows = q.reshape(*lead, hkv * g, 1, d)
        per_head = self.q.kernel_forward(layer, rows)  # the CPU kernel, without the module call's overhead
        if per_head is None:
            per_head = self.q(layer, rows)
        return per_head.reshape(*lead, hkv, g, self.phi_dim)


def weights_digest(state: dict[str, torch.Tensor]) -> int:
    """A 62-bit digest of a state dict (fits the int64 metadata of a φ cache)."""
    return int(tensors_digest(state)[:16], 16) >> 2


def load_feature_map(model_dir: str | Path) -> ReZeroMLPFeatureMap | None:
    """The distilled map shipped in a local model folder, or None when it has none."""
    folder = Path(model_dir)
    if not (folder / MAP_CONFIG).is_file():
        return None
    from safetensors.torch import load_file  # local import: only models with a map need it

    cfg = json.loads((folder / MAP_CONFIG).read_text())
    if cfg.get("kind") != MAP_KINDS[ReZeroMLPFeatureMap.kind]:
        raise ValueError(f"{folder / MAP_CONFIG}: unsupported map kind {cfg.get('kind')!r}")
    shape = {k: int(cfg[k]) for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "phi_dim", "hidden")}
    fmap = ReZeroMLPFeatureMap(**shape)
    state = load_file(str(folder / MAP_WEIGHTS))
    fmap.load_state_dict(state)
    fmap.digest = weights_digest(state)
    return fmap.eval().requires_grad_(False)
