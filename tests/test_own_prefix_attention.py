"""One decode row over its own tokens with the prefix's partial attention as a pseudo-entry
(``workers.step_batch.own_and_prefix_attention``) equals the two partial softmaxes merged (``merge_attention``).

Tolerances: float32 1e-5 relative to the output scale; bfloat16 inputs compared after the final bf16 rounding
(one bf16 ulp, 2**-7 relative).
"""

from __future__ import annotations

import pytest
import torch

from workers.attention import dense_attention, merge_attention
from workers.step_batch import own_and_prefix_attention

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _case(hq: int, hkv: int, s: int, d: int, dtype: torch.dtype, device: str, empty_prefix: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, d, generator=g).to(device, dtype)
    k = torch.randn(hkv, s, d, generator=g).to(device, dtype)
    v = torch.randn(hkv, s, d, generator=g).to(device, dtype)
    o_pre = torch.randn(1, hq, d, generator=g).to(device)
    lse_pre = (torch.randn(1, hq, generator=g) * 3).to(device)
    if empty_prefix:  # nothing of the prefix attended: lse -inf, out 0
        lse_pre.fill_(float("-inf"))
        o_pre.zero_()
    return q, k, v, o_pre, lse_pre


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "n_own"), [(4, 4, 1), (8, 2, 5), (32, 8, 37)])
@pytest.mark.parametrize("empty_prefix", [False, True])
def test_pseudo_entry_equals_the_merge(device: str, dtype: torch.dtype, hq: int, hkv: int, n_own: int,
                                       empty_prefix: bool) -> None:
    d, s = 64, 48  # the buffer holds more rows than are valid: rows past n_valid must not count
    q, k, v, o_pre, lse_pre = _case(hq, hkv, s, d, dtype, device, empty_prefix)
    n_valid = torch.full((1, hkv), n_own, device=device)
    scale = d ** -0.5
    got = own_and_prefix_attention(q, k, v, n_valid, scale, o_pre, lse_pre)
    assert got.dtype == dtype and got.shape == (1, hq, d)
    o_own, lse_own = dense_attention(q.float()[:, :, None], k[None, :, :n_own].float(), v[None, :, :n_own].float(),
                                     scale)
    want, _ = merge_attention(o_own, lse_own, o_pre[:, :, None], lse_pre[:, :, None])
    want = want[:, :, 0].to(dtype).float()
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
