"""K-means assignment kernel == its torch reference (nearest centroid, ties to the lower index).

The Triton kernel runs in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU)
or on CUDA. Outputs are pre-filled with -1 (``torch.empty`` poisoned), so an unwritten label fails.

Near-ties may legitimately flip between the kernel and the float32 reference (other summation order,
tf32 operands), so labels are compared three ways:
- well-separated clusters (points within 0.05 sigma of their centre, centres ~20 apart): labels equal
  exactly, in the kernel, the reference and the generating labels;
- integer-valued inputs (every product, sum and distance exact in bf16, tf32 and float32), with duplicated
  centroids: labels equal exactly, the first index of the minimum (exact ties to the lower index);
- random inputs: the float64 distance of the kernel's centroid exceeds the float64 minimum by at most
  ``TOL(point) = 2 * max_c err(c)``, where ``err(c)`` bounds the error of one computed distance
  ``||c||^2 - 2 x . c``: ``2 (2u + u^2 + g) |x| |c| + g |c|^2`` with ``g = (D + 2) 2^-24`` (float32 sums of
  D products, then the subtraction) and ``u`` the operands' rounding: 0 for bf16/fp16 and for float32 under
  ``"ieee"``, 2^-10 for float32 under ``"tf32"`` (10 mantissa bits, truncated at worst), 2^-9 for float32
  centroids rounded to bf16 x. If the kernel picks ``k`` over the true nearest ``j``, then
  ``d(k) <= d^(k) + err(k) <= d^(j) + err(k) <= d(j) + err(j) + err(k)``. At D = 128 on unit-normal data
  that is ~0.005 exact-product (~1 tf32) against distance gaps of ~5 between nearest centroids, so a wrong
  but non-tied choice fails. The reference meets the same bound with ``u = 0``.
"""

from __future__ import annotations

import os

import pytest
import torch

import workers.kernels.kmeans_assign.ops as ka_ops
import workers.methods.kmeans as km
from workers.kernels.kmeans_assign import MAX_HEAD_DIM, KmeansAssignConfig, kmeans_assign, kmeans_assign_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMALL = KmeansAssignConfig(block_n=16, block_c=16, num_warps=2, num_stages=1)
IEEE = KmeansAssignConfig(fp32_precision="ieee")
CONFIGS = {"default": KmeansAssignConfig(), "small-blocks": SMALL, "ieee": IEEE}


def _operand_rounding(x: torch.Tensor, centroids: torch.Tensor, config: KmeansAssignConfig) -> float:
    """``u``: relative rounding of the kernel's product operands (module docstring)."""
    if x.dtype != torch.float32:
        return 0.0 if centroids.dtype == x.dtype else 2.0**-9
    return 2.0**-10 if config.fp32_precision == "tf32" else 0.0


def _assert_near_optimal(labels: torch.Tensor, x: torch.Tensor, centroids: torch.Tensor, u: float) -> None:
    """Every point's chosen centroid is within ``TOL(point)`` of its nearest one, in float64."""
    xd, cd = x.double(), centroids.double()
    assert labels.shape == x.shape[:2] and labels.dtype == torch.int64
    assert ((labels >= 0) & (labels < cd.shape[1])).all(), "label out of range (unwritten?)"
    dist = torch.cdist(xd, cd).square()  # [H, n, C]
    chosen = dist.gather(2, labels[..., None])[..., 0]
    g = (x.shape[-1] + 2) * 2.0**-24
    xn, cn = xd.norm(dim=-1), cd.norm(dim=-1)
    err = 2 * (2 * u + u * u + g) * xn[..., None] * cn[:, None, :] + g * cn[:, None, :].square()
    excess = chosen - dist.min(-1).values - 2 * err.max(-1).values
    assert excess.max().item() <= 0, f"a chosen centroid is {excess.max().item():.3g} past the tolerance"


def _separated(h: int, n: int, c: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(points, centres, generating labels): each point 0.05 sigma from its centre, centres 4 sigma apart."""
    gen = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(h, c, d, generator=gen)
    truth = torch.randint(0, c, (h, n), generator=gen)
    x = centres.gather(1, truth[..., None].expand(-1, -1, d)) + 0.05 * torch.randn(h, n, d, generator=gen)
    return x.to(DEV, dtype), centres.to(DEV, dtype), truth.to(DEV)


def _integers(h: int, n: int, c: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer points and centroids in [-3, 3], the centroids drawn from 8 distinct rows (many duplicates)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (h, n, d), generator=gen).float()
    rows = torch.randint(-3, 4, (h, 8, d), generator=gen).float()
    centroids = rows.gather(1, torch.randint(0, 8, (h, c), generator=gen)[..., None].expand(-1, -1, d))
    centroids[:, -1] = centroids[:, 0]  # at least one duplicate, in the last centroid block
    return x.to(DEV, dtype), centroids.to(DEV, dtype)


def _first_nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Exact (int64) lowest index among the nearest centroids of integer-valued inputs."""
    xi, ci = x.long().cpu(), centroids.long().cpu()  # CUDA has no integer matmul
    dist = ci.square().sum(-1)[:, None, :] - 2 * torch.einsum("hnd,hcd->hnc", xi, ci)
    first = (dist == dist.min(-1, keepdim=True).values).int().argmax(-1)  # argmax: the first maximum
    return first.to(x.device)


@pytest.fixture()
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels the launcher allocates start as -1, so a label the kernel does not write fails."""
    real = ka_ops._empty

    def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return real(*shape, dtype=dtype, device=device).fill_(-1)

    monkeypatch.setattr(ka_ops, "_empty", empty)


FAST_SHAPES = {(1, 1, 1), (3, 17, 5), (1, 1000, 64), (8, 17, 300)}
"""The grid's points that stay in the inner test loop (one point per, one block of centroids, many blocks of
points, many of centroids); the rest of the grid is marked slow (the interpreter is slow)."""
SHAPES = [(h, n, c) if (h, n, c) in FAST_SHAPES else pytest.param(h, n, c, marks=pytest.mark.slow)
          for h in (1, 3, 8) for n in (1, 17, 1000) for c in (1, 5, 64, 300)]


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("h,n,c", SHAPES)
def test_separated_clusters_labels_equal(h: int, n: int, c: int, d: int, dtype: torch.dtype) -> None:
    x, centres, truth = _separated(h, n, c, d, dtype, seed=h * 10007 + n * 101 + c + d)
    out = kmeans_assign(x, centres, use_triton=True)
    assert torch.equal(kmeans_assign_ref(x, centres), truth)
    assert torch.equal(out, truth)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("h,n,c", SHAPES)
def test_random_inputs_chosen_distance_within_tolerance(h: int, n: int, c: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(h * 10007 + n * 101 + c + d)
    x = (torch.randn(h, n, d, generator=gen) + 0.5).to(DEV, dtype)  # keys share a mean direction
    centroids = (torch.randn(h, c, d, generator=gen) + 0.5).to(DEV, dtype)
    out = kmeans_assign(x, centroids, use_triton=True)
    _assert_near_optimal(out, x, centroids, _operand_rounding(x, centroids, ka_ops.DEFAULT_KMEANS_ASSIGN))
    _assert_near_optimal(kmeans_assign_ref(x, centroids), x, centroids, 0.0)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("h,n,c,d", [(1, 17, 5, 64), (3, 200, 300, 96), (2, 70, 64, 128), (2, 33, 40, 8)])
def test_exact_ties_break_to_lower_index(h: int, n: int, c: int, d: int, dtype: torch.dtype,
                                         config: KmeansAssignConfig) -> None:
    """Duplicated centroids (within and across centroid blocks) and tied distances: the first index wins."""
    x, centroids = _integers(h, n, c, d, dtype, seed=n + c + d)
    expected = _first_nearest(x, centroids)
    assert (centroids[:, :, None] == centroids[:, None]).all(-1).sum() > h * c  # duplicates are present
    assert torch.equal(kmeans_assign_ref(x, centroids), expected)
    assert torch.equal(kmeans_assign(x, centroids, use_triton=True, config=config), expected)


@needs_triton
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_strided_and_mixed_dtype_inputs(config: KmeansAssignConfig) -> None:
    """x a strided slice of a larger bf16 buffer (as ``k[:, lo:hi]``), centroids float32 and transposed."""
    gen = torch.Generator().manual_seed(5)
    h, n, c, d = 3, 90, 70, 64
    base = torch.randn(n + 20, h, 2 * d, generator=gen).to(DEV, torch.bfloat16)
    x = base[10:10 + n, :, ::2].transpose(0, 1)  # [H, n, D], no unit stride
    assert not x.is_contiguous() and x.stride(-1) == 2
    centroids = torch.randn(h, d, c, generator=gen).to(DEV).transpose(1, 2)
    out = kmeans_assign(x, centroids, use_triton=True, config=config)
    _assert_near_optimal(out, x, centroids, _operand_rounding(x, centroids, config))
    same = kmeans_assign(x.contiguous(), centroids.contiguous(), use_triton=True, config=config)
    assert torch.equal(out, same)  # strides change addresses only


@needs_triton
@pytest.mark.parametrize("config", [KmeansAssignConfig(), SMALL], ids=["default", "small-blocks"])
def test_kmeans_through_the_kernel_equals_the_reference_path(monkeypatch: pytest.MonkeyPatch,
                                                             config: KmeansAssignConfig) -> None:
    """Lloyd's k-means (seeded init, early stop, means) gives the same clusters with either assignment."""
    x, _, _ = _separated(2, 300, 12, 64, torch.float32, seed=9)
    ref = km.kmeans(x, 12, seed=3)
    calls: list[int] = []

    def through_kernel(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return kmeans_assign(x, centroids, use_triton=True, config=config)

    monkeypatch.setattr(km, "kmeans_assign", through_kernel)
    got = km.kmeans(x, 12, seed=3)
    assert calls and torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], atol=1e-6)


def test_cpu_tensors_use_the_reference_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``use_triton`` CPU tensors never reach the kernel (the interpreter would make CPU tests slow)."""
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kernel was launched for CPU tensors")

    monkeypatch.setattr(ka_ops, "_launch", no_launch)
    x, centres, truth = _separated(2, 50, 7, 64, torch.float32, seed=1)
    assert torch.equal(kmeans_assign(x.cpu(), centres.cpu()), truth.cpu())
    assert torch.equal(km.assign(x.cpu(), centres.cpu()), truth.cpu())


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_no_points(use_triton: bool) -> None:
    out = kmeans_assign(torch.zeros(3, 0, 64, device=DEV), torch.zeros(3, 4, 64, device=DEV), use_triton=use_triton)
    assert out.shape == (3, 0) and out.dtype == torch.int64


@pytest.mark.parametrize("x_shape,c_shape,dtype,match", [
    ((2, 5, 64), (3, 4, 64), torch.float32, "do not match"),
    ((2, 5, 64), (2, 4, 32), torch.float32, "do not match"),
    ((5, 64), (4, 64), torch.float32, "must be a float tensor"),
    ((2, 5, 64), (2, 0, 64), torch.float32, "at least one centroid"),
    ((2, 5, 64), (2, 4, 64), torch.float64, "bf16/fp16/fp32"),
])
def test_invalid_calls_are_rejected(x_shape: tuple[int, ...], c_shape: tuple[int, ...], dtype: torch.dtype,
                                    match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kmeans_assign(torch.zeros(x_shape, dtype=dtype), torch.zeros(c_shape, dtype=dtype))


def test_head_dims_past_the_kernels_limit_are_rejected() -> None:
    x, c = torch.zeros(1, 4, MAX_HEAD_DIM + 1), torch.zeros(1, 2, MAX_HEAD_DIM + 1)
    with pytest.raises(ValueError, match=f"D <= {MAX_HEAD_DIM}"):
        kmeans_assign(x, c, use_triton=True)
    assert kmeans_assign(x, c, use_triton=False).shape == (1, 4)  # the reference takes any D


@pytest.mark.parametrize("kwargs", [{"block_n": 8}, {"block_c": 48}, {"num_warps": 3}, {"num_stages": 0},
                                    {"fp32_precision": "bf16"}])
def test_invalid_configs_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="KmeansAssignConfig"):
        KmeansAssignConfig(**kwargs)


def test_reference_is_the_former_assign_on_float32() -> None:
    """The reference is what ``kmeans.assign`` computed before the kernel (float32 einsum, argmin)."""
    gen = torch.Generator().manual_seed(2)
    x, c = torch.randn(3, 100, 64, generator=gen), torch.randn(3, 30, 64, generator=gen)
    former = ((c.square().sum(-1)[:, None, :] - 2 * torch.einsum("hnd,hcd->hnc", x, c)).argmin(-1))
    assert torch.equal(kmeans_assign_ref(x, c), former)
    assert torch.equal(kmeans_assign_ref(x, c, chunk=7), former)  # chunking is invisible
