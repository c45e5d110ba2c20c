"""HybridKV's offline head statistic: the share of KVzip's keep set, and the file that records it."""

from __future__ import annotations

import pytest
import torch

from lab.compress.head_select import keep_share
from workers.methods.head_scores import HeadScores


def test_keep_share_counts_each_heads_part_of_the_global_top() -> None:
    scores = torch.tensor([[[0.9, 0.1, 0.8, 0.0], [0.2, 0.95, 0.05, 0.01]],
                           [[0.3, 0.02, 0.03, 0.04], [0.7, 0.6, 0.5, 0.06]]])  # [layers 2, kv_heads 2, n 4]
    # the top 25 % of 16 scores: 0.95, 0.9, 0.8, 0.7 -> head (0, 0) holds two, (0, 1) and (1, 1) one each
    share = keep_share(scores, 0.25)
    assert torch.equal(share, torch.tensor([[0.5, 0.25], [0.0, 0.25]]))
    assert keep_share(scores, 1.0).sum() == pytest.approx(1.0)
    # the ranking keeps the heads holding the keep set (a tie goes to the later head): not (1, 0), with none
    ranking = HeadScores(scores=tuple(tuple(row) for row in share.tolist()), statistic="share", head_fraction=0.5)
    assert ranking.top(0.5) == [[True, False], [False, True]]


def test_statistic_is_recorded_and_old_files_read_as_the_papers() -> None:
    share = HeadScores(scores=((0.4, 0.1), (0.3, 0.2)), statistic="share")
    again = HeadScores.from_json(share.to_json())
    assert again == share and '"statistic": "share"' in share.to_json()
    paper = HeadScores(scores=((1.0, 0.99), (0.98, 0.97)))
    assert '"statistic"' not in paper.to_json()  # the file of a max ranking is what it always was
    assert HeadScores.from_json(paper.to_json()).statistic == "max"
    assert share.digest != HeadScores(scores=share.scores).digest  # the statistic names the scores it makes
    with pytest.raises(ValueError, match="unknown head statistic"):
        HeadScores(scores=((0.1,),), statistic="mean")
