"""The token -> page arithmetic every decode path shares (``workers/pages.py``)."""

from __future__ import annotations

import torch

from workers.pages import page_count, page_mask, page_of, page_span


def test_counts_spans_and_pages_of_tokens() -> None:
    assert [page_count(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert page_span(4, 36, 16) == (0, 3) and page_span(16, 32, 16) == (1, 2) and page_span(5, 5, 16) == (0, 1)
    assert page_of(torch.tensor([0, 15, 16, 47]), 16).tolist() == [0, 0, 1, 2]


def test_page_mask_marks_the_pages_of_the_counted_ids_only() -> None:
    # 2 rows x 2 heads x 4 ids; counts cut each row short: ids past the count mark nothing.
    tokens = torch.tensor([[[0, 17, 99, 99], [40, 41, 5, 99]],
                           [[33, 0, 0, 0], [99, 99, 99, 99]]])
    counts = torch.tensor([[2, 3], [1, 0]])
    mask, outside = page_mask(tokens, counts, n_tokens=45, page_size=16)
    assert mask.tolist() == [[True, True, True], [True, False, True]] and int(outside) == 0
    counts[0, 0] = 3  # id 99 is now counted: outside the 45-token prefix
    _, outside = page_mask(tokens, counts, n_tokens=45, page_size=16)
    assert int(outside) == 1
