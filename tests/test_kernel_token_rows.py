"""The CPU token-rows kernel (``workers/kernels/token_rows``) == its plain torch reference: the same pool rows and
the same number of distinct pages read, over leading dims, padding past the counts (in and outside the prefix),
repeated pages and ids outside the prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.kernels.token_rows import cpu_kernel_available, page_rows, token_rows, token_rows_ref

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the kernel is not built")


@pytest.mark.parametrize("lead", [(), (1,), (3,)])
@pytest.mark.parametrize("hkv,n,page,n_tokens", [(2, 40, 16, 200), (1, 5, 4, 17), (8, 300, 16, 4055),
                                                  (2, 1, 16, 16)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_equals_the_torch_reference(lead: tuple[int, ...], hkv: int, n: int, page: int, n_tokens: int,
                                           seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_pages = -(-n_tokens // page)
    first = torch.randperm(4 * hkv * n_pages, generator=gen)[:hkv * n_pages].view(hkv, n_pages) * page
    tokens = torch.randint(0, n_tokens, (*lead, hkv, n), generator=gen)
    counts = torch.randint(0, n + 1, (*lead, hkv), generator=gen)
    pad = torch.arange(n) >= counts.unsqueeze(-1)
    if seed == 1:  # padding outside the prefix (the host view's -1 and past-the-end ids)
        tokens = torch.where(pad, torch.where(torch.rand(tokens.shape, generator=gen) < 0.5, -1, n_tokens), tokens)
    got_rows, got_n = token_rows(tokens, counts, first, page, n_tokens)
    want_rows, want_n = token_rows_ref(tokens, counts, first, page, n_tokens)
    assert got_rows.dtype == torch.int64 and torch.equal(got_rows, want_rows) and got_n == want_n


def test_a_valid_id_outside_the_prefix_raises() -> None:
    first = torch.zeros(2, 4, dtype=torch.int64)
    for bad in (-1, 64):
        tokens = torch.tensor([[3, bad], [0, 0]])
        with pytest.raises(ValueError, match="token ids"):
            token_rows(tokens, torch.tensor([2, 1]), first, 16, 64)
        with pytest.raises(ValueError, match="token ids"):
            token_rows_ref(tokens, torch.tensor([2, 1]), first, 16, 64)


@pytest.mark.parametrize("hkv,n,n_pages", [(2, 12, 256), (1, 1, 3), (8, 70, 1014)])
@pytest.mark.parametrize("strided", [False, True])
def test_page_rows_equals_the_host_views_numpy(hkv: int, n: int, n_pages: int, strided: bool) -> None:
    """``page_rows``: ``HostPageView.page_rows``' numpy (first rows, -1 for padding, distinct (head, page) pairs of
    the real ids, repeats included), on contiguous and transposed ids; an id past the prefix raises."""
    gen = torch.Generator().manual_seed(hkv * 100 + n)
    first = torch.randperm(4 * hkv * n_pages, generator=gen)[:hkv * n_pages].view(hkv, n_pages) * 16
    pages = torch.randint(-1, n_pages, (hkv, n), generator=gen)
    pages[:, -1] = pages[:, 0]  # a repeated page per head
    if strided:
        pages = pages.t().contiguous().t()
    got, got_n = page_rows(pages, first)
    p = pages.numpy()
    heads = np.arange(hkv)[:, None]
    want = np.where(p >= 0, first.numpy()[heads, np.maximum(p, 0)], -1)
    assert np.array_equal(got.numpy(), want) and got.is_contiguous()
    assert got_n == int(np.unique((heads * n_pages + p)[p >= 0]).size)
    with pytest.raises(ValueError, match="page ids"):
        page_rows(torch.full((hkv, 1), n_pages), first)
