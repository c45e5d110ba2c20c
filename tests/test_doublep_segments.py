"""Double-P's prefill clustering within fixed-size token segments: one segment is the unsegmented k-means bit
for bit; longer mid regions give per-segment clusters with global ids in the unchanged artifact format."""

from __future__ import annotations

import math

import pytest
import torch

from workers.attention import dense_attention
from workers.methods import doublep
from workers.methods.doublep import ClusterSummarizer, DoubleP, DoublePSelector
from workers.methods.kmeans import kmeans
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.selector import LayerContext
from workers.requests import DecodeConfig

SINK, TAIL = 4, 16
SEG = 64
FULL, REST = 3, 37
"""The segmented cases' mid region: three full segments of ``SEG`` tokens and a shorter last one."""


class SmallSegments(ClusterSummarizer):
    """Segments of ``SEG`` tokens, so a few hundred tokens make several."""

    segment_tokens = SEG


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kv(n_mid: int, d: int = 8, hkv: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n = SINK + n_mid + TAIL
    return torch.randn(hkv, n, d, generator=_gen(seed)), torch.randn(hkv, n, d, generator=_gen(seed + 1))


@pytest.mark.parametrize("summarizer,n_mid", [(ClusterSummarizer, 280), (SmallSegments, SEG),
                                              (SmallSegments, SEG - 5)])
def test_one_segment_is_the_unsegmented_kmeans_bit_for_bit(summarizer: type[ClusterSummarizer], n_mid: int) -> None:
    k, v = _kv(n_mid, seed=2)
    layer = 3
    s = summarizer().summarize(layer, k, v)
    c = math.ceil(n_mid / summarizer.cluster_size)
    cent, labels = kmeans(k[:, SINK:SINK + n_mid].float(), c, iters=summarizer.iters, seed=summarizer.seed + layer,
                          init=summarizer.init)
    assert s["meta"].tolist() == [SINK, SINK + n_mid, c]
    assert torch.equal(s["centroids"], cent)
    assert torch.equal(s["perm"].long(), torch.sort(labels, dim=1, stable=True).indices + SINK)


def _segment_of(token: torch.Tensor) -> torch.Tensor:
    return (token - SINK) // SEG


def test_segments_cluster_apart_with_global_ids_in_the_same_format() -> None:
    k, v = _kv(FULL * SEG + REST, seed=4)
    hkv, d = k.shape[0], k.shape[-1]
    s = SmallSegments().summarize(0, k, v)
    lo, hi, c = s["meta"].tolist()
    per_seg = SEG // SmallSegments.cluster_size
    assert (lo, hi) == (SINK, SINK + FULL * SEG + REST)
    assert c == FULL * per_seg + math.ceil(REST / SmallSegments.cluster_size)
    assert s["centroids"].shape == (hkv, c, d) and s["centroids"].dtype == torch.float32
    assert s["vsum"].shape == (hkv, c, d) and s["sizes"].shape == (hkv, c) and s["offsets"].shape == (hkv, c + 1)
    for h in range(hkv):
        assert sorted(s["perm"][h].tolist()) == list(range(lo, hi))
        off, sizes = s["offsets"][h].long(), s["sizes"][h].long()
        assert off[0] == 0 and torch.equal(off[1:], sizes.cumsum(0))
        for i in range(c):
            members = s["perm"][h, off[i]:off[i + 1]].long()
            # segment s's clusters come after segment s - 1's: cluster i lies in segment min(i // per_seg, FULL)
            assert (_segment_of(members) == min(i // per_seg, FULL)).all(), (h, i)
            torch.testing.assert_close(s["vsum"][h, i], v[h, members].sum(0), rtol=1e-5, atol=1e-5)
            if len(members):
                torch.testing.assert_close(s["centroids"][h, i], k[h, members].mean(0), rtol=1e-5, atol=1e-5)
        assert (sizes > 0).sum() > c // 2  # real clusterings, not one cluster per segment


def test_equal_segments_are_one_batched_kmeans_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full segments are extra rows of one call; the shorter last segment is a second one."""
    shapes = []

    def spy(x: torch.Tensor, n_clusters: int, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        shapes.append((tuple(x.shape), n_clusters))
        return kmeans(x, n_clusters, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(doublep, "kmeans", spy)
    k, v = _kv(FULL * SEG + REST, d=8, hkv=2, seed=6)
    a = SmallSegments().summarize(1, k, v)
    assert shapes == [((2 * FULL, SEG, 8), SEG // 8), ((2, REST, 8), math.ceil(REST / 8))]
    b = SmallSegments().summarize(1, k, v)
    assert all(torch.equal(a[key], b[key]) for key in a)  # seeded: the same summary twice


def test_doublep_on_a_segmented_summary_reads_a_planted_key_exactly() -> None:
    hkv, g, d = 2, 2, 16
    k, v = _kv(FULL * SEG + REST, d=d, hkv=hkv, seed=8)
    n = k.shape[1]
    planted = SINK + 2 * SEG + 11  # inside the third segment: its clusters' ids are shifted by two segments'
    direction = torch.randn(hkv, d, generator=_gen(9))
    direction = direction / direction.norm(dim=-1, keepdim=True)
    k[:, planted] = 6 * direction
    q = (4 * direction).repeat_interleave(g, 0)[None, :, None]  # [1, Hq, 1, D], every query head aims at it
    src = MemorySource.build([(k, v)], [SmallSegments])
    art = src.artifact("clusters")
    perm, off = art["0.perm"].long(), art["0.offsets"].long()
    for h in range(hkv):
        pos = int((perm[h] == planted).nonzero())
        cluster = int(torch.searchsorted(off[h, 1:], torch.tensor(pos), right=True))
        assert (_segment_of(perm[h, off[h, cluster]:off[h, cluster + 1]]) == 2).all()  # a segment's own cluster

    scale = d ** -0.5
    sel = DoublePSelector(src, p1=0.95, p2=0.7, centroid_fallback=True)
    ctx = LayerContext(ResidentKV(k, v, page_size=16), SINK, n - TAIL)
    sel.prepare(0, ctx)
    picked = sel.select(0, ctx, q[:, :, 0].reshape(1, hkv, g, d), scale, None)
    for h in range(hkv):
        assert planted in picked.tokens[0, h, :int(picked.counts[0, h])].tolist(), h

    out, _ = DoubleP(p1=0.95, p2=0.7).open(src, DecodeConfig()).attend(0, q, scale)
    ref, _ = dense_attention(q, k[None], v[None], scale)
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.05)
