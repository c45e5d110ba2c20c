"""Unit top-k kernels == their torch references (exact ids for ``top_units``; for ``group_top_units`` the
same ids up to float rounding of the mass, checked by the mass they select).

The Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU)
or on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels.unit_topk import (
    TopConfig,
    group_mass_ref,
    group_top_units,
    group_top_units_ref,
    top_units,
    top_units_ref,
)
from workers.kernels.unit_topk.cpu import cpu_kernel_available, top_units_cpu
from workers.methods.selector import group_mass

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
SMALL = TopConfig(block_units=64, num_warps=2, split_units=0)  # one program per row, several chunks
SPLIT = TopConfig(split_units=64, num_warps=2)  # rows over several programs even at small U
SPLIT_FEW = TopConfig(split_units=16, max_splits=4, num_warps=2)  # ... with chunks grown to fit 4 programs
# The chunked variants are slow in the interpreter: the inner loop (test-fast) runs one of each path.
CONFIGS = [pytest.param(TopConfig(split_units=0), id="row"),
           pytest.param(SMALL, id="row-chunks", marks=pytest.mark.slow),
           pytest.param(SPLIT, id="split"),
           pytest.param(SPLIT_FEW, id="split-few", marks=pytest.mark.slow)]


def _ascending_unique(ids: torch.Tensor) -> bool:
    return bool((ids[:, 1:] > ids[:, :-1]).all())


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("r,u,k", [(1, 1, 1), (3, 17, 5), pytest.param(8, 300, 40, marks=pytest.mark.slow),
                                   (2, 257, 256), (4, 64, 64), (5, 40, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_units_equals_reference(r: int, u: int, k: int, dtype: torch.dtype, config: TopConfig) -> None:
    g = torch.Generator().manual_seed(r * 1000 + u)
    scores = torch.randn(r, u, generator=g).to(dtype).to(DEV)  # bf16: many ties, broken toward lower ids
    got = top_units(scores, k, use_triton=True, config=config)
    want = top_units_ref(scores, k)
    assert got.shape == (r, min(k, u)) and got.dtype == torch.int64
    assert torch.equal(got, want)


@needs_triton
def test_top_units_orders_signs_zeros_and_infinities() -> None:
    row = torch.tensor([[0.0, -0.0, -1.0, 2.0, float("-inf"), float("inf"), -3.5, 1e-30, -1e-30, 2.0]], device=DEV)
    for k in range(1, 11):
        for config in (SMALL, TopConfig(split_units=16)):
            assert torch.equal(top_units(row, k, use_triton=True, config=config), top_units_ref(row, k)), (k, config)


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("r,g_,u,k", [(1, 1, 1, 1), pytest.param(8, 4, 300, 9, marks=pytest.mark.slow),
                                       (3, 5, 129, 100), (2, 8, 33, 7),
                                       pytest.param(3, 4, 1000, 20, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_top_units_selects_the_reference_mass(r: int, g_: int, u: int, k: int, dtype: torch.dtype,
                                                     config: TopConfig) -> None:
    g = torch.Generator().manual_seed(g_ * 100 + u)
    logits = (3 * torch.randn(r, g_, u, generator=g)).to(dtype).to(DEV)
    got = group_top_units(logits, k, use_triton=True, config=config)
    want = group_top_units_ref(logits, k)
    assert got.shape == want.shape and _ascending_unique(got)
    mass = group_mass_ref(logits)
    # The kernel's mass differs from softmax + mean by float rounding only: the same selected mass.
    torch.testing.assert_close(mass.gather(1, got).sum(1), mass.gather(1, want).sum(1), rtol=1e-5, atol=1e-6)
    same = (got == want).float().mean().item()
    assert same > 0.95, same


@needs_triton
def test_group_top_units_gives_minus_inf_no_mass() -> None:
    logits = torch.randn(2, 3, 50, device=DEV)
    logits[0, :, 10:] = float("-inf")  # only units 0..9 have mass in row 0
    logits[1, 1] = float("-inf")  # one head with nothing: it adds no mass, and no NaN
    got = group_top_units(logits, 10, use_triton=True, config=SPLIT)  # chunks of -inf only, too
    assert torch.equal(got[0], torch.arange(10, device=DEV))
    assert torch.equal(group_top_units(logits, 10, use_triton=True, config=SMALL), got)
    mass = group_mass_ref(logits)
    assert not mass.isnan().any()
    torch.testing.assert_close(mass.gather(1, got).sum(1), mass.gather(1, group_top_units_ref(logits, 10)).sum(1))


def test_reference_mass_is_the_selectors_group_mass() -> None:
    logits = torch.randn(3, 4, 2, 37)
    logits[0, 1, 1] = float("-inf")
    torch.testing.assert_close(group_mass_ref(logits.reshape(12, 2, 37)), group_mass(logits).reshape(12, 37))


def test_reference_breaks_ties_toward_lower_ids_in_ascending_order() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert top_units_ref(scores, 2).tolist() == [[1, 2]]
    assert top_units_ref(scores, 4).tolist() == [[1, 2, 3, 4]]


def test_launchers_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="float"):
        top_units(torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="G, U"):
        group_top_units(torch.zeros(2, 3), 1)
    with pytest.raises(ValueError, match="power of two"):
        TopConfig(block_units=100)
    with pytest.raises(ValueError, match="split_units"):
        TopConfig(split_units=100)


needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="the CPU unit top-k kernel did not build")


@needs_cpu_kernel
@pytest.mark.parametrize("r,u,k", [(1, 1, 1), (3, 17, 5), (8, 300, 40), (2, 257, 256), (4, 64, 64), (5, 40, 0),
                                   (2, 253, 10), (3, 0, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_cpu_kernel_equals_reference(r: int, u: int, k: int, ties: bool) -> None:
    """The C++ kernel (float32 CPU scores off Triton: ``top_units`` and ``group_top_units``' selection): the
    reference's ids exactly, ties (scores rounded to a few values) toward lower ids, strided rows too."""
    g = torch.Generator().manual_seed(r * 1000 + u)
    scores = torch.randn(r, u, generator=g)
    if ties:
        scores = scores.mul(2).round()
    want = top_units_ref(scores, k)
    for s in (scores, scores.t().contiguous().t(), torch.cat([scores, scores], 1)[:, :u]):
        got = top_units_cpu(s, k)
        assert got.shape == want.shape and got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(top_units(scores, k, use_triton=False), want)
    logits = torch.randn(r, 3, u, generator=g)
    if ties:
        logits[:, :, : u // 2] = float("-inf")  # no mass: ties at 0
    assert torch.equal(group_top_units(logits, k, use_triton=False), group_top_units_ref(logits, k))


@needs_cpu_kernel
def test_cpu_kernel_orders_signs_zeros_and_infinities() -> None:
    row = torch.tensor([[0.0, -0.0, -1.0, 2.0, float("-inf"), float("inf"), -3.5, 1e-30, -1e-30, 2.0]])
    for k in range(0, 11):
        assert torch.equal(top_units_cpu(row, k), top_units_ref(row, k)), k
