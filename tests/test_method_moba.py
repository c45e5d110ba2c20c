"""MoBA's block means and block selection against a brute-force reference written from the definition."""

from __future__ import annotations

import pytest
import torch

from workers.methods.layer_kv import ResidentKV
from workers.methods.moba import MobaBlocks, MobaSelector
from workers.methods.selector import LayerContext


def _blocks(k: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    s = MobaBlocks()
    s.block = block
    out = s.summarize(0, k, k)
    return {"0.kmean": out["kmean"], "0.meta": out["meta"]}


def _brute_force(k: torch.Tensor, q: torch.Tensor, scale: float, block: int, lo: int, hi: int,
                 budget: int) -> list[list[set[int]]]:
    """Per (query token, KV head): the mid tokens of the best blocks, taken while their mid tokens fit."""
    hkv, n, _ = k.shape
    t, _, g, _ = q.shape
    first, last = lo // block, (hi - 1) // block
    out = []
    for i in range(t):
        row = []
        for h in range(hkv):
            means = {b: k[h, b * block:min(n, (b + 1) * block)].mean(0) for b in range(first, last + 1)}
            mass = {b: 0.0 for b in means}
            for j in range(g):
                logits = {b: float(q[i, h, j] @ m) * scale for b, m in means.items()}
                z = sum(torch.exp(torch.tensor(x - max(logits.values()))).item() for x in logits.values())
                for b, x in logits.items():
                    mass[b] += torch.exp(torch.tensor(x - max(logits.values()))).item() / z / g
            taken: set[int] = set()
            for b in sorted(mass, key=lambda b: (-mass[b], b)):
                mid = set(range(max(lo, b * block), min(hi, (b + 1) * block)))
                if len(taken) + len(mid) > budget:
                    break
                taken |= mid
            row.append(taken)
        out.append(row)
    return out


def test_block_means_are_means() -> None:
    k = torch.randn(2, 70, 8)
    got = _blocks(k, 32)["0.kmean"]
    for b, (s, e) in enumerate([(0, 32), (32, 64), (64, 70)]):
        torch.testing.assert_close(got[:, b], k[:, s:e].mean(1))


@pytest.mark.parametrize(("n", "block", "g", "lo", "hi", "budget"), [
    (200, 16, 2, 4, 184, 48),   # budget of three whole blocks
    (200, 16, 4, 4, 184, 40),   # GQA 4, budget between block sizes
    (131, 32, 1, 9, 128, 70),   # partial first mid block and partial last block
    (64, 16, 2, 4, 48, 0),      # nothing fits
])
def test_selection_equals_brute_force(n: int, block: int, g: int, lo: int, hi: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(n + block + g)
    hkv, d, t = 2, 16, 3
    k = torch.randn(hkv, n, d, generator=gen)
    q = torch.randn(t, hkv, g, d, generator=gen) + 2 * k[:, 100 % n][None, :, None]  # favours one block
    scale = d ** -0.5
    sel = MobaSelector(_blocks(k, block))
    ctx = LayerContext(kv=ResidentKV(k, k, page_size=16), lo=lo, hi=hi)
    got = sel.select(0, ctx, q, scale, budget)
    want = _brute_force(k, q, scale, block, lo, hi, budget)
    for i in range(t):
        for h in range(hkv):
            ids = set(got.tokens[i, h, : int(got.counts[i, h])].tolist())
            assert ids == want[i][h], (i, h)
    assert any(want[i][h] for i in range(t) for h in range(hkv)) or budget == 0


def _paper_top_block(k: torch.Tensor, q: torch.Tensor, block: int, lo: int, hi: int) -> list[int]:
    """Per query head, MoBA's gate from the paper in plain torch: argmax over mid blocks of q . mean(K_block)."""
    hkv, n, _ = k.shape
    g = q.shape[0] // hkv
    first, last = lo // block, (hi - 1) // block
    out = []
    for h in range(q.shape[0]):
        kh = k[h // g]
        scores = [float(q[h] @ kh[b * block:min(n, (b + 1) * block)].mean(0)) for b in range(first, last + 1)]
        out.append(first + max(range(len(scores)), key=scores.__getitem__))
    return out


def test_aligned_block_is_attended_per_kv_head() -> None:
    """Each KV head has one 64-token block whose keys align with its own query group, and a decoy block aligned
    (more strongly) with the other group's queries: at a budget of one block, the method attends exactly the
    anchors and the aligned block (GQA head mapping, block bounds and the budget's translation to blocks, all
    checked against exact attention over those tokens)."""
    from workers.attention import dense_attention
    from workers.methods.memory import MemorySource
    from workers.methods.moba import Moba
    from workers.requests import DecodeConfig

    gen = torch.Generator().manual_seed(0)
    hkv, g, n, d, block = 2, 4, 1030, 32, MobaBlocks.block
    sink, tail = 4, 16
    targets, decoys = (3, 9), (12, 5)  # per KV head: the block aligned with its group, and the decoy
    k = 0.3 * torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    dirs = torch.linalg.qr(torch.randn(d, hkv, generator=gen)).Q.T  # orthonormal: one direction per group
    for h in range(hkv):
        k[h, targets[h] * block:(targets[h] + 1) * block] += 3 * dirs[h]
        k[h, decoys[h] * block:(decoys[h] + 1) * block] += 6 * dirs[1 - h]
    q = 8 * dirs.repeat_interleave(g, 0) + 0.1 * torch.randn(hkv * g, d, generator=gen)  # [Hq, D]
    assert _paper_top_block(k, q, block, sink, n - tail) == [targets[h // g] for h in range(hkv * g)]
    src = MemorySource.build([(k, v)], Moba.summarizers)
    attn = Moba().open(src, DecodeConfig(budget=0.1, sink=sink, tail=tail))  # 103 - 20 = 83 mid tokens: one block
    scale = d ** -0.5
    out, lse = attn.attend(0, q[None, :, None], scale)
    for h, b in enumerate(targets):
        keep = torch.cat([torch.arange(sink), torch.arange(b * block, (b + 1) * block), torch.arange(n - tail, n)])
        heads = slice(h * g, (h + 1) * g)
        ref, ref_lse = dense_attention(q[None, heads, None], k[None, h:h + 1, keep], v[None, h:h + 1, keep], scale)
        torch.testing.assert_close(out[:, heads], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, heads], ref_lse, atol=1e-5, rtol=0)
