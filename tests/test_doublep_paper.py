"""Double-P against an independent float64 reference of the paper (eq. 6-9), its budget rule, and its reads.

The reference rebuilds every cluster from the stored token order alone (centroid = mean key, size,
mean value), ranks clusters by the group-mean of ``softmax(q C^T scale + log s)``, keeps the top-``p1``
prefix, attends the top-``p2`` prefix (or, under a budget, the largest shared threshold whose exact
tokens fit) token by token and the rest of the top-``p1`` prefix through ``(log s_i + q C_i^T scale, V̄_i)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.attention import dense_attention
from workers.budget import plan_budget
from workers.methods.doublep import ClusterSummarizer, DoubleP
from workers.methods.memory import MemorySource
from workers.requests import DecodeConfig

SINK, TAIL = 4, 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference(src: MemorySource, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, scale: float, *, p1: float,
               p2: float, budget_k: int | None) -> tuple[torch.Tensor, list[list[int]]]:
    """Float64 Double-P of one layer: q ``[Hq, D]`` -> (out ``[Hq, D]``, exact clusters per KV head)."""
    art = src.artifact("clusters")
    perm, off = art["0.perm"].long(), art["0.offsets"].long()
    hkv, n, _ = k.shape
    g = q.shape[0] // hkv
    k, v, q = k.double(), v.double(), q.double()
    members = [[perm[h, off[h, c]:off[h, c + 1]] for c in range(off.shape[1] - 1)] for h in range(hkv)]
    heads = []
    for h in range(hkv):
        cs = [c for c, m in enumerate(members[h]) if len(m)]
        cent = torch.stack([k[h, members[h][c]].mean(0) for c in cs])
        size = torch.tensor([float(len(members[h][c])) for c in cs], dtype=torch.float64)
        est = q[h * g:(h + 1) * g] @ cent.T * scale + size.log()  # [G, C]
        ahat = torch.softmax(est, -1).mean(0)
        ranked = sorted(range(len(cs)), key=lambda i: (-float(ahat[i]), cs[i]))
        before = [float(sum(ahat[j] for j in ranked[:r])) for r in range(len(ranked))]
        n1 = next(r + 1 for r in range(len(ranked)) if before[r] + float(ahat[ranked[r]]) >= p1 - 1e-12)
        n2 = min(n1, next(r + 1 for r in range(len(ranked)) if before[r] + float(ahat[ranked[r]]) >= p2 - 1e-12))
        heads.append((cs, cent, size, est, ranked, before, n1, n2))
    if budget_k is not None:  # the largest threshold shared by the KV heads whose exact tokens fit hkv * k
        cands = sorted({b for *_, before, _, n2 in heads for b in before[:n2]} | {math.inf})
        best = 0.0
        for p in cands:
            cost = sum(int(size[ranked[r]]) for cs, _, size, _, ranked, before, _, n2 in heads
                       for r in range(n2) if before[r] < p)
            if cost <= hkv * budget_k:
                best = p
        heads = [(*x[:7], sum(1 for r in range(x[7]) if x[5][r] < best)) for x in heads]
    anchors = torch.cat([torch.arange(SINK), torch.arange(n - TAIL, n)])
    outs, chosen = [], []
    for h, (cs, _, _, est, ranked, _, n1, n2) in enumerate(heads):
        exact = [cs[i] for i in ranked[:n2]]
        approx = ranked[n2:n1]
        toks = torch.cat([anchors, *[members[h][c] for c in exact]])
        logits = torch.cat([q[h * g:(h + 1) * g] @ k[h, toks].T * scale, est[:, approx]], -1)
        vbar = torch.stack([v[h, members[h][cs[i]]].mean(0) for i in approx]) if approx else v.new_zeros(0, k.shape[-1])
        outs.append(torch.softmax(logits, -1) @ torch.cat([v[h, toks], vbar]))
        chosen.append(sorted(exact))
    return torch.cat(outs), chosen


def _case(seed: int, n: int = 600, d: int = 16, hkv: int = 2, g: int = 2):
    k = torch.randn(hkv, n, d, generator=_gen(seed))
    v = torch.randn(hkv, n, d, generator=_gen(seed + 1))
    q = torch.randn(1, hkv * g, 1, d, generator=_gen(seed + 2)) * 1.5
    return k, v, q, MemorySource.build([(k, v)], [ClusterSummarizer])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("p1,p2,budget", [(0.95, 0.7, None), (0.9, 0.3, None), (0.95, 0.7, 0.08),
                                          (0.99, 0.9, 0.12)])
def test_doublep_matches_a_float64_reference_of_the_paper(seed: int, p1: float, p2: float,
                                                          budget: float | None) -> None:
    k, v, q, src = _case(10 * seed)
    scale = 0.25
    budget_k = None if budget is None else plan_budget(prefill_len=k.shape[1], fraction=budget, head_dim=16).k_topk
    ref, chosen = _reference(src, k, v, q[0, :, 0], scale, p1=p1, p2=p2, budget_k=budget_k)
    attn = DoubleP(p1=p1, p2=p2).open(src, DecodeConfig(budget=budget))
    out, _ = attn.attend(0, q, scale)
    torch.testing.assert_close(out[0, :, 0].double(), ref, atol=2e-5, rtol=2e-5)
    if budget_k is not None:  # the budget rule really binds here (fewer exact clusters than top-p2 alone)
        free, _ = _reference(src, k, v, q[0, :, 0], scale, p1=p1, p2=p2, budget_k=None)
        assert not torch.allclose(free, ref)
        got = attn.read_report().extra["exact_tokens_per_step"] - 2 * (SINK + TAIL)
        assert got <= 2 * budget_k


def _peaked(seed: int, n: int = 4096, d: int = 32, hkv: int = 2, g: int = 2, steps: int = 8):
    """Topic-clustered keys; each query aims sharply at one mid token's key (float64)."""
    gen = _gen(seed)
    topic = torch.randint(n // 64, (n,), generator=gen).sort().values
    centers = torch.randn(hkv, n // 64, d, generator=gen, dtype=torch.float64)
    k = centers[:, topic] + 0.7 * torch.randn(hkv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(hkv, n, d, generator=gen, dtype=torch.float64)
    target = torch.randint(SINK, n - TAIL, (steps,), generator=gen)
    q = torch.empty(1, hkv * g, steps, d, dtype=torch.float64)
    for h in range(hkv * g):
        for j in range(steps):
            key = k[h // g, target[j]]
            q[0, h, j] = 3 * key / key.norm() * math.sqrt(d) + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    return k, v, q


def _error(src: MemorySource, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, budget: float | None) -> float:
    scale = k.shape[-1] ** -0.5
    attn = DoubleP().open(src, DecodeConfig(budget=budget))
    out = torch.cat([attn.attend(0, q[:, :, j:j + 1].float(), scale)[0] for j in range(q.shape[2])], 2).double()
    ref, _ = dense_attention(q, k[None], v[None], scale)
    return float(((out - ref).abs().sum(-1) / ref.abs().sum(-1)).mean())


@pytest.mark.parametrize("seed", [0, 2])
def test_doublep_error_is_monotone_in_the_budget(seed: int) -> None:
    """No budget is the limit of ever larger budgets (the paper's top-p2), and error never rises on the way."""
    k, v, q = _peaked(seed)
    src = MemorySource.build([(k.float(), v.float())], [ClusterSummarizer])
    errors = [_error(src, k, v, q, b) for b in (0.01, 0.02, 0.05, 0.2, None)]
    assert all(b <= a + 1e-9 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0]


def test_doublep_charges_its_centroid_reads_per_step() -> None:
    """Stage 1 scores every centroid each step; the approximated clusters' K/V rows are attended."""
    k, v, q, src = _case(3, n=800)
    attn = DoubleP().open(src, DecodeConfig())
    steps = 3
    for j in range(steps):
        attn.attend(0, q * (j + 1), 0.25)
    rep = attn.read_report()
    art = src.artifact("clusters")
    n_clusters, d = int(art["0.meta"][2]), k.shape[-1]
    scan = 2 * n_clusters * d * 4  # fp32 centroids of both KV heads, every step
    pseudo = rep.extra["pseudo_entries_per_step"] * steps * 2 * d * 4  # one K and one V row (fp32 prefix here)
    token_bytes = src.layout.token_kv_bytes()
    index = rep.step_bytes - sum(rep.tokens_per_step) * token_bytes
    assert index >= steps * scan + pseudo
    assert rep.extra["index_bytes"] == index
    assert rep.extra["index_token_equiv_per_step"] >= n_clusters * d * 4 / token_bytes
