"""The sparse decode path on CUDA (the Triton kernel) against exact attention and the CPU path.

Skipped without a GPU. Run on one with ``TRITON_INTERPRET=0 pytest tests/test_methods_cuda.py``.
Tolerances: fp32 1e-4 (kernel fp32 vs float64 reference / fp32 dense), bf16 3e-2 (inputs and
outputs rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from workers.attention import dense_attention
from workers.methods.memory import MemorySource, summarize_layers
from workers.methods.registry import METHODS, QUERY_TIME, compression_methods, get_method
from workers.requests import DecodeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPARSE = sorted(m for m in METHODS if m != "full" and m not in QUERY_TIME and m not in compression_methods())
"""Methods that select over the stored prefix per step (compressed caches: tests/test_compressed.py)."""


def _kv(n: int, hkv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return (torch.randn(hkv, n, d, generator=g).to(dtype), torch.randn(hkv, n, d, generator=g).to(dtype))


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("n", "hkv", "g", "d", "l"), [(1000, 2, 4, 64, 1), (777, 8, 4, 128, 3), (33, 1, 8, 64, 1)])
def test_full_budget_on_cuda_equals_exact(method: str, dtype: torch.dtype, tol: float, n: int, hkv: int, g: int,
                                          d: int, l: int) -> None:
    k, v = (t.cuda() for t in _kv(n, hkv, d, dtype))
    src = MemorySource.build([(k, v)], METHODS[method].summarizers)
    q = (torch.randn(1, hkv * g, l, d, generator=torch.Generator().manual_seed(2)) * 2).to(dtype).cuda()
    out, lse = get_method(method).open(src, DecodeConfig(budget=1.0)).attend(0, q, d ** -0.5)
    ref, ref_lse = dense_attention(q, k[None], v[None], d ** -0.5)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("budget", [0.02, 0.1, None])
def test_cuda_path_equals_cpu_path(method: str, budget: float | None) -> None:
    """Same summaries (built on the CPU), same queries: the kernel path matches the float64 reference path."""
    n, hkv, g, d = 2000, 4, 4, 64
    k, v = _kv(n, hkv, d, torch.float32)
    arts = summarize_layers([(k, v)], METHODS[method].summarizers)
    q = torch.randn(1, hkv * g, 2, d, generator=torch.Generator().manual_seed(3)) * 3
    cfg = DecodeConfig(budget=budget, gen_len=64)  # a feasible φ plan at 2% of 2000 tokens (gen_len=1 is not)
    cpu_out, cpu_lse = get_method(method).open(MemorySource([(k, v)], arts), cfg).attend(0, q, d ** -0.5)
    gpu_arts = {name: {key: t.cuda() for key, t in a.items()} for name, a in arts.items()}
    gpu = get_method(method).open(MemorySource([(k.cuda(), v.cuda())], gpu_arts), cfg)
    gpu_out, gpu_lse = gpu.attend(0, q.cuda(), d ** -0.5)
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu_lse.cpu(), cpu_lse, atol=1e-4, rtol=1e-4)
    assert gpu.read_report().tokens_per_step[0] > 0
