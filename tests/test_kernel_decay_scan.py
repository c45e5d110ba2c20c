"""Decay scan kernels == the torch reference (forward and gradients), and the reference == its definition.

The Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU) or on
CUDA. Tolerances: float32 outputs and gradients within 1e-5 (absolute and relative; the chunked scan
reassociates products of gates); bfloat16 outputs within 2e-2 (both sides round a float32 state to
bfloat16, so they differ by at most about one bfloat16 step of values of order 1).
"""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels.decay_scan import DecayScanConfig, decay_scan, decay_scan_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(lengths: list[int], heads: int, dim: int, dtype: torch.dtype, seed: int, h0: bool):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    x = torch.randn(n, heads, dim, generator=g).to(DEV, dtype)
    gate = torch.rand(n, heads, dim, generator=g).to(DEV, dtype)  # anywhere in [0, 1): short and long memories
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    init = torch.randn(len(lengths), heads, dim, generator=g).to(DEV, dtype) if h0 else None
    return x, gate, cu, init


CASES = [  # segment lengths (1, odd, across chunk boundaries, long, an empty one), heads, head dim, config
    ([1], 1, 8, DecayScanConfig(block_t=16, block_d=8)),
    ([7], 2, 16, DecayScanConfig(block_t=4, block_d=16)),
    ([1, 33, 0, 64, 5], 2, 20, DecayScanConfig(block_t=16, block_d=8)),
    # Long segments at the default configs: 7-15 s each in the CPU interpreter, so outside the inner loop.
    pytest.param([257, 1, 63], 3, 64, DecayScanConfig(), marks=pytest.mark.slow),
    pytest.param([600], 2, 64, DecayScanConfig(block_t=64, block_d=64), marks=pytest.mark.slow),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize(("lengths", "heads", "dim", "config"), CASES)
def test_triton_forward_equals_reference(lengths, heads, dim, config, h0, dtype) -> None:
    x, gate, cu, init = _inputs(lengths, heads, dim, dtype, seed=len(lengths) + dim, h0=h0)
    y = decay_scan(x, gate, cu, init, use_triton=True, config=config)
    ref = decay_scan_ref(x, gate, cu, init)
    assert y.dtype == dtype and y.shape == x.shape
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize(("lengths", "heads", "dim", "config"), CASES[:4])
def test_triton_gradients_equal_reference(lengths, heads, dim, config, h0) -> None:
    x, gate, cu, init = _inputs(lengths, heads, dim, torch.float32, seed=7, h0=h0)
    leaves = [t.clone().requires_grad_() for t in (x, gate, *([init] if h0 else []))]
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    grads = []
    for use_triton in (False, True):
        xs, gs, *rest = [t.detach().clone().requires_grad_() for t in leaves]
        y = decay_scan(xs, gs, cu, rest[0] if rest else None, use_triton=use_triton, config=config)
        grads.append(torch.autograd.grad((y * w).sum(), [xs, gs, *rest]))
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_recurrence() -> None:
    """Constant gate c: y_t = (1 - c) Σ_{s<=t} c^{t-s} x_s + c^{t+1} h0 (the closed form, per segment)."""
    c, n = 0.75, 9
    x = torch.randn(n, 1, 3, dtype=torch.float64)
    h0 = torch.randn(2, 1, 3, dtype=torch.float64)
    cu = torch.tensor([0, 4, n])
    y = decay_scan_ref(x, torch.full_like(x, c), cu, h0)
    for s, (a, b) in enumerate([(0, 4), (4, n)]):
        for t in range(a, b):
            want = (1 - c) * sum(c ** (t - j) * x[j] for j in range(a, t + 1)) + c ** (t - a + 1) * h0[s]
            torch.testing.assert_close(y[t].float(), want.float())


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_split_scan_continues_from_last_state(use_triton: bool) -> None:
    """Scanning [0, m) then [m, n) from the first part's last output equals one scan (chunked prefill)."""
    x, gate, _, _ = _inputs([50], 2, 16, torch.float32, seed=3, h0=False)
    whole = decay_scan(x, gate, use_triton=use_triton)
    first = decay_scan(x[:23], gate[:23], use_triton=use_triton)
    rest = decay_scan(x[23:], gate[23:], h0=first[-1:], use_triton=use_triton)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-6, rtol=1e-6)


def test_launcher_rejects_bad_calls() -> None:
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="x and g"):
        decay_scan(x, torch.zeros(4, 2, 7))
    with pytest.raises(ValueError, match="cu_seqlens"):
        decay_scan(x, x, torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match="h0"):
        decay_scan(x, x, torch.tensor([0, 4]), torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="power of two"):
        DecayScanConfig(block_t=48)
