"""Page gather kernel == its torch reference, and both == the page bytes they copy.

The Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU)
or on CUDA. Pools are pre-filled with NaN, so a slot the gather must not write stays NaN and an
unwritten one fails; pools are compared bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from workers.kernels.gather_pages import GatherConfig, gather_pages, gather_pages_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if torch.cuda.is_available() and not INTERP else "cpu")
needs_triton = pytest.mark.skipif(DEV.type == "cpu" and not INTERP,
                                  reason="CPU tensors through Triton need TRITON_INTERPRET=1")
WIDE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _case(page: int, d: int, dtype: torch.dtype, n_src: int, n_slots: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    block = page * d * dtype.itemsize
    page_bytes = -(-2 * block // 64) * 64 + 64  # K block, V block, padding
    src = torch.randint(0, 256, (n_src, page_bytes), dtype=torch.uint8, generator=g).to(DEV)
    pools = [torch.full((n_slots * page, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
    return src, pools, block


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(WIDE[t.dtype])


@needs_triton
@pytest.mark.parametrize("config", [GatherConfig(), GatherConfig(block_bytes=64, num_warps=2),
                                    GatherConfig(whole_page=True, num_warps=1)], ids=["default", "chunks", "page"])
@pytest.mark.parametrize("page,d,dtype", [(16, 8, torch.float32), (16, 128, torch.bfloat16),
                                          (4, 3, torch.float16), (7, 5, torch.float32)])
@pytest.mark.parametrize("skip_negative", [False, True])
def test_triton_equals_reference(page: int, d: int, dtype: torch.dtype, config: GatherConfig,
                                 skip_negative: bool) -> None:
    src, (k, v), block = _case(page, d, dtype, n_src=11, n_slots=9, seed=page + d)
    rows = torch.tensor([3, -1, 10, 0, -1, 7] if skip_negative else [3, 9, 10, 0, 2, 7], device=DEV)
    dst = torch.tensor([8, 0, 1, 4, 2, 6], device=DEV)
    k2, v2 = k.clone(), v.clone()
    gather_pages(src, rows, k, v, dst, block_bytes=block, use_triton=True, skip_negative=skip_negative,
                 config=config)
    gather_pages_ref(src, rows, k2, v2, dst, block_bytes=block, skip_negative=skip_negative)
    assert torch.equal(_bits(k), _bits(k2)) and torch.equal(_bits(v), _bits(v2))
    for s, slot in zip(rows.tolist(), dst.tolist()):
        kk, vv = k[slot * page : (slot + 1) * page], v[slot * page : (slot + 1) * page]
        if s < 0:  # skipped: the slot (not written by any other entry here) stays NaN
            assert kk.isnan().all() and vv.isnan().all()
            continue
        assert torch.equal(kk.contiguous().view(torch.uint8).reshape(-1), src[s, :block])
        assert torch.equal(vv.contiguous().view(torch.uint8).reshape(-1), src[s, block : 2 * block])


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_gather_copies_k_and_v_blocks_into_slots(use_triton: bool) -> None:
    p, d, page_bytes = 4, 8, 4096
    block = p * d * 4
    src = torch.randint(0, 256, (6, page_bytes), dtype=torch.uint8).to(DEV)
    kp = torch.full((5 * p, d), float("nan"), device=DEV)
    vp = torch.full((5 * p, d), float("nan"), device=DEV)
    gather_pages(src, torch.tensor([4, 0, 5], device=DEV), kp, vp, torch.tensor([2, 0, 4], device=DEV),
                 block_bytes=block, use_triton=use_triton)
    for s, dst in ((4, 2), (0, 0), (5, 4)):
        assert torch.equal(kp[dst * p : (dst + 1) * p].view(torch.uint8).reshape(-1), src[s, :block])
        assert torch.equal(vp[dst * p : (dst + 1) * p].view(torch.uint8).reshape(-1), src[s, block : 2 * block])
    assert kp[p : 2 * p].isnan().all() and vp[3 * p : 4 * p].isnan().all()


@pytest.mark.parametrize("use_triton,whole_page", [(False, False), pytest.param(True, False, marks=needs_triton),
                                                   pytest.param(True, True, marks=needs_triton)])
def test_gather_skips_negative_rows(use_triton: bool, whole_page: bool) -> None:
    page_bytes, block = 4096, 2 * 16 * 4  # D=2 float32 pools, page 16 -> 128 B blocks
    src = torch.randint(0, 256, (10, page_bytes), dtype=torch.uint8).to(DEV)
    rows = torch.tensor([3, -1, 7, -1, 0], device=DEV)
    dst = torch.tensor([4, 0, 1, 2, 0], device=DEV)
    k = torch.full((6 * 16, 2), float("nan"), device=DEV)
    v = torch.full_like(k, float("nan"))
    gather_pages(src, rows, k, v, dst, block_bytes=block, use_triton=use_triton, skip_negative=True,
                 config=GatherConfig(whole_page=whole_page))
    for s, d in ((3, 4), (7, 1), (0, 0)):
        assert torch.equal(k[d * 16 : (d + 1) * 16].view(torch.uint8).reshape(-1), src[s, :block])
        assert torch.equal(v[d * 16 : (d + 1) * 16].view(torch.uint8).reshape(-1), src[s, block : 2 * block])
    for d in (2, 3, 5):
        assert k[d * 16 : (d + 1) * 16].isnan().all() and v[d * 16 : (d + 1) * 16].isnan().all()


def test_invalid_calls_say_how_to_fix_them() -> None:
    src, (k, v), block = _case(16, 8, torch.float32, n_src=4, n_slots=4)
    rows, dst = torch.tensor([0, 1], device=DEV), torch.tensor([2, 3], device=DEV)
    with pytest.raises(ValueError, match="uint8"):
        gather_pages(src.view(torch.int32), rows, k, v, dst, block_bytes=block)
    with pytest.raises(ValueError, match="K\\+V block bytes"):
        gather_pages(src, rows, k, v, dst, block_bytes=src.shape[1])
    with pytest.raises(ValueError, match="one shape and dtype"):
        gather_pages(src, rows, k, v[:-1], dst, block_bytes=block)
    with pytest.raises(ValueError, match="1-D of one length"):
        gather_pages(src, rows, k, v, dst[:1], block_bytes=block)
    with pytest.raises(ValueError, match="int32/int64"):
        gather_pages(src, rows.float(), k, v, dst, block_bytes=block)
    with pytest.raises(ValueError, match="power of two"):
        GatherConfig(block_bytes=3000)
    with pytest.raises(ValueError, match="num_warps"):
        GatherConfig(num_warps=3)
