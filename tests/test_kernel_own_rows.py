"""Own-row write kernel == its torch reference (an ``index_copy_`` per member and tensor).

The Triton kernel runs in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU) or on
CUDA. It copies values (no arithmetic), so results must be bit-equal; buffers start as NaN so a row written to
the wrong place, or not at all, fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels.own_rows import own_rows_table, write_own_rows, write_own_rows_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")


def _buffers(sizes: list[int], hkv: int, d: int, dtype: torch.dtype, layers: int = 3, layer: int = 1
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per member, one layer's K and V views ``[Hkv, S_m, D]`` of an ``OwnKV``-shaped buffer ``[L, 2, Hkv, S_m, D]``
    (NaN-filled), the members' buffers of different sizes."""
    bufs = [torch.full((layers, 2, hkv, s, d), float("nan"), dtype=dtype, device=DEV) for s in sizes]
    return [b[layer, 0] for b in bufs], [b[layer, 1] for b in bufs]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sizes,hkv,d", [([5], 1, 16), ([8, 3, 13], 2, 64), ([4, 4], 8, 128), ([9, 2], 4, 96)])
def test_kernel_writes_what_the_reference_writes(sizes: list[int], hkv: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(sizes) * 100 + d)
    m = len(sizes)
    packed = torch.randn(2, hkv, m, d, generator=gen).to(DEV, dtype)  # the step's packed K, V [Hkv, B, D]
    k, v = packed[0].transpose(0, 1), packed[1].transpose(0, 1)  # [M, Hkv, D] strided views, as the step has them
    at = torch.tensor([(3 * i + 1) % s for i, s in enumerate(sizes)], dtype=torch.int64, device=DEV)
    ks, vs = _buffers(sizes, hkv, d, dtype)
    want_k, want_v = _buffers(sizes, hkv, d, dtype)
    write_own_rows(k, v, at, own_rows_table(ks, vs), use_triton=True)
    write_own_rows_ref(k, v, at, want_k, want_v)
    for i in range(m):
        assert torch.equal(ks[i].nan_to_num(7.0), want_k[i].nan_to_num(7.0)), f"member {i}'s K"
        assert torch.equal(vs[i].nan_to_num(7.0), want_v[i].nan_to_num(7.0)), f"member {i}'s V"
        assert torch.equal(ks[i][:, int(at[i])], k[i]) and torch.equal(vs[i][:, int(at[i])], v[i])
        assert ks[i].isnan().sum() == ks[i].numel() - hkv * d  # nothing else written


def test_the_reference_path_writes_each_members_row() -> None:
    ks, vs = _buffers([4, 6], 2, 8, torch.float32)
    k, v = torch.randn(2, 2, 8, device=DEV), torch.randn(2, 2, 8, device=DEV)
    at = torch.tensor([3, 0], device=DEV)
    write_own_rows(k, v, at, own_rows_table(ks, vs), use_triton=False)
    assert torch.equal(ks[0][:, 3], k[0]) and torch.equal(vs[1][:, 0], v[1])


def test_bad_calls_are_refused() -> None:
    ks, vs = _buffers([4, 6], 2, 8, torch.float32)
    own = own_rows_table(ks, vs)
    k = torch.randn(2, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="k must be"):
        write_own_rows(k[:1], k, torch.zeros(2, dtype=torch.int64, device=DEV), own)
    with pytest.raises(ValueError, match="at must be"):
        write_own_rows(k, k, torch.zeros(2, dtype=torch.int32, device=DEV), own)
    with pytest.raises(ValueError, match="one K and one V"):
        own_rows_table(ks, vs[:1])
    with pytest.raises(ValueError, match="every buffer"):
        own_rows_table([ks[0], ks[1][..., :4]], vs)
