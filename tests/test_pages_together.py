"""Members picking their pages together (``workers.methods.pages_together``) pick what each would pick alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.methods.layer_kv import ResidentKV
from workers.methods.moba import MobaSelector
from workers.methods.pages_together import PageScoring, PagesTogether
from workers.methods.quest import QuestSelector
from workers.methods.selector import LayerContext

HKV, G, D, PAGE = 2, 3, 16, 4


def _selector(n_tokens: int, seed: int, device: str = "cpu") -> tuple[QuestSelector, LayerContext]:
    """A Quest selector over random page bounds of an ``n_tokens`` prefix, and the layer's context (sink 4, tail 8)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, n_tokens, D, generator=gen).to(device)
    pages = k.view(HKV, -1, PAGE, D)
    bounds = {"0.kmax": pages.amax(2), "0.kmin": pages.amin(2), "0.meta": torch.tensor([PAGE])}
    ctx = LayerContext(ResidentKV(k, k, PAGE), 4, n_tokens - 8)
    return QuestSelector(bounds), ctx


def _scoring(sel: QuestSelector, ctx: LayerContext, n: int, anchors: torch.Tensor) -> PageScoring:
    scored = sel.page_bounds(0, ctx)
    assert scored is not None
    return PageScoring(scored=scored, n_pages=n, anchor_pages=anchors)


def test_like_members_pick_together_what_each_picks_alone() -> None:
    n = 5
    anchors = torch.tensor([[0, 15], [0, 15]])
    members = [_selector(64, seed) for seed in (1, 2, 3)] + [_selector(80, 4)]  # the last: another length
    scorings: list[Any] = [lambda layer, s=s, c=c: _scoring(s, c, n, anchors) for s, c in members]
    scorings.append(None)  # a member that cannot pick together (e.g. full attention)
    together = PagesTogether(scorings, n_layers=1)
    assert together.members(0) == {0, 1, 2}
    q = torch.randn(1, HKV * G, len(scorings), D, generator=torch.Generator().manual_seed(9))
    picked = together.pick(0, q, 0.25)
    assert set(picked) == {0, 1, 2}
    for i in (0, 1, 2):
        sel, ctx = members[i]
        alone = sel.select_pages(0, ctx, q[0, :, i].reshape(1, HKV, G, D), 0.25, n)[0]
        assert torch.equal(picked[i], torch.cat([alone, anchors], dim=1)), i
    # the members' queries matter: swapping two members' rows swaps what they pick
    swapped = together.pick(0, q[:, :, [1, 0, 2, 3, 4]], 0.25)
    assert not torch.equal(swapped[0], picked[0])


def test_members_out_of_order_pick_with_their_own_rows() -> None:
    n = 3
    anchors = torch.tensor([[0], [0]])
    a, b = _selector(64, 5), _selector(64, 6)
    scorings: list[Any] = [lambda layer: _scoring(*a, n, anchors), None, lambda layer: _scoring(*b, n, anchors)]
    together = PagesTogether(scorings, n_layers=1)
    q = torch.randn(1, HKV * G, 3, D, generator=torch.Generator().manual_seed(3))
    picked = together.pick(0, q, 0.25)
    for i, (sel, ctx) in ((0, a), (2, b)):
        alone = sel.select_pages(0, ctx, q[0, :, i].reshape(1, HKV, G, D), 0.25, n)[0]
        assert torch.equal(picked[i][:, :n], alone)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_out_of_order_members_pick_inside_a_cuda_graph() -> None:
    """Members that are not one contiguous run of the step (another method between them) pick in a captured
    step: their rows are gathered with an index made before the capture, not copied from the host."""
    n, dev = 3, "cuda"
    anchors = torch.tensor([[0], [0]], device=dev)
    a, b = _selector(64, 5, dev), _selector(64, 6, dev)
    scorings: list[Any] = [lambda layer: _scoring(*a, n, anchors), None, lambda layer: _scoring(*b, n, anchors)]
    together = PagesTogether(scorings, n_layers=1)
    q = torch.randn(1, HKV * G, 3, D, generator=torch.Generator().manual_seed(3)).to(dev)
    eager = together.pick(0, q, 0.25)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        together.pick(0, q, 0.25)  # warm-up outside the capture (kernel compilation, allocator)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = together.pick(0, q, 0.25)
    graph.replay()
    torch.cuda.synchronize()
    for i in (0, 2):
        assert torch.equal(captured[i], eager[i]), i


def test_a_member_alone_or_of_another_shape_picks_alone() -> None:
    anchors = torch.tensor([[0], [0]])
    a, b = _selector(64, 1), _selector(64, 2)
    scorings: list[Any] = [lambda layer: _scoring(*a, 3, anchors), lambda layer: _scoring(*b, 4, anchors)]
    assert PagesTogether(scorings, n_layers=1).members(0) == set()  # another page count


def test_moba_ranks_blocks_its_own_way_and_picks_alone() -> None:
    k = torch.randn(HKV, 64, D)
    blocks = {"0.kmean": k.view(HKV, -1, PAGE, D).mean(2), "0.meta": torch.tensor([PAGE])}
    ctx = LayerContext(ResidentKV(k, k, PAGE), 4, 56)
    assert MobaSelector(blocks).page_bounds(0, ctx) is None
