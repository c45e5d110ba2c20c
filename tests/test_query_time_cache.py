"""Query-time caches (SnapKV; LookaheadKV's keep set): exact while the query is fed, then only the kept entries.

Numeric properties: a budget covering the prefix equals exact attention after ``query_done``;
the error against exact attention falls as ``budget_tokens`` grows; each step after the query reads
exactly ``budget_tokens`` entries per layer and KV head; greedy generation through the worker with a
covering budget emits the tokens of ``full``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_methods import DOC, planted, random_kv, rel_l1
from workers.attention import ObservesQuery, dense_attention
from workers.engine import Worker
from workers.kernels.dense_attention import dense_attention_ref
from workers.methods.keep_set import (
    KeepConfig,
    QueryTimeAttention,
    keep_ids,
    pooled_scores,
    prefix_attention_and_mass,
    prefix_attention_mass,
)
from workers.methods.memory import MemorySource
from workers.methods.registry import get_method
from workers.own_kv import OwnKV
from workers.requests import DecodeConfig, GenerationStats, SamplingParams


def _own(src: MemorySource) -> OwnKV:
    return OwnKV(src.layout, 4, torch.device("cpu"), torch.float32)


def test_keep_ids_count_anchors_in_the_budget() -> None:
    scores = torch.zeros(2, 100)
    scores[0, 50], scores[1, 60], scores[1, 30] = 5.0, 4.0, 3.0
    ids = keep_ids(scores, KeepConfig(budget_tokens=7, sink=2, tail=3))
    assert ids.shape == (2, 7)
    assert ids[0].tolist()[:2] == [0, 1] and ids[0].tolist()[-3:] == [97, 98, 99] and 50 in ids[0].tolist()
    assert {30, 60} <= set(ids[1].tolist())
    assert keep_ids(scores, KeepConfig(budget_tokens=500, sink=2, tail=3)).shape == (2, 100)
    tail_first = keep_ids(scores, KeepConfig(budget_tokens=4, sink=2, tail=3))  # anchors overflow: tail wins
    assert tail_first[0].tolist() == [0, 97, 98, 99] or tail_first[0].tolist() == [1, 97, 98, 99]


def test_pooled_scores_max_pool_then_group_mean() -> None:
    mass = torch.zeros(4, 20)
    mass[0, 10] = 1.0
    pooled = pooled_scores(mass, n_kv_heads=2, kernel=3)
    assert pooled[0, 9:12].tolist() == [0.5, 0.5, 0.5] and pooled[0].sum() == 1.5 and pooled[1].abs().sum() == 0


def test_prefix_attention_mass_sums_rows_of_a_softmax() -> None:
    q, k = torch.randn(4, 3, 8), torch.randn(2, 50, 8)
    mass = prefix_attention_mass(q, k, 0.3)
    torch.testing.assert_close(mass.sum(-1), torch.full((4,), 3.0))
    ref = torch.softmax(q[1] @ k[0].T * 0.3, -1).sum(0)  # head 1 is in KV head 0's group of 2
    torch.testing.assert_close(mass[1], ref)


@pytest.mark.parametrize(("hkv", "g", "rows", "n", "mass_from"), [(2, 4, 9, 300, 0), (2, 2, 5, 17, 3), (1, 1, 1, 1, 0),
                                                              (4, 2, 12, 64, 11)])
def test_prefix_attention_and_mass_equal_the_two_separate_passes(hkv: int, g: int, rows: int, n: int,
                                                                 mass_from: int) -> None:
    """One score matrix gives what ``dense_attention_ref`` and ``prefix_attention_mass`` give apart (fp32, atol 1e-5),
    and gradients flow through the mass (LookaheadKV's training uses it)."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, hkv * g, rows, 16, generator=gen, requires_grad=True)
    k, v = torch.randn(hkv, n, 16, generator=gen), torch.randn(hkv, n, 16, generator=gen)
    out, lse, mass = prefix_attention_and_mass(q, k, v, 0.25, mass_from)
    want_out, want_lse = dense_attention_ref(q, k[None], v[None], 0.25)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, prefix_attention_mass(q[0, :, mass_from:], k, 0.25), atol=1e-5, rtol=1e-5)
    w = torch.randn(mass.shape, generator=gen)
    (grad,) = torch.autograd.grad((mass * w).sum() + out.sum(), q)
    q2 = q.detach().clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad((prefix_attention_mass(q2[0, :, mass_from:], k, 0.25) * w).sum()
                                       + dense_attention_ref(q2, k[None], v[None], 0.25)[0].sum(), q2)
    torch.testing.assert_close(grad, want_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("n", "g", "budget"), [(203, 2, 203), (150, 4, 10_000), (17, 1, 64)])
def test_covering_budget_equals_exact_attention_after_the_query(n: int, g: int, budget: int) -> None:
    hkv, d = 2, 16
    kv = random_kv(2, hkv, n, d, seed=n)
    src = MemorySource.build(kv, ())
    attn = get_method("snapkv").open(src, DecodeConfig(budget_tokens=budget))
    assert isinstance(attn, ObservesQuery)
    q = torch.randn(1, hkv * g, 5, d, generator=torch.Generator().manual_seed(2))
    for layer in range(2):
        attn.attend(layer, q, d ** -0.5)  # the query
    attn.query_done(_own(src), n + 5)
    step = q[:, :, -1:] * 1.3
    for layer, (k, v) in enumerate(kv):
        out, lse = attn.attend(layer, step, d ** -0.5)
        ref, ref_lse = dense_attention(step, k[None], v[None], d ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_error_falls_as_budget_tokens_grow_and_reads_match_the_budget() -> None:
    n, hkv, g, d = 1000, 2, 4, 32
    kv, q = planted(n=n, d=d, hkv=hkv, g=g, n_q=6, seed=11)
    k, v = kv[0]
    step = q[:, :, :1]  # the answer's query looks for what the question looked for
    ref, _ = dense_attention(step, k[None], v[None], d ** -0.5)
    src = MemorySource.build(kv, ())
    errs = []
    for budget in (32, 64, 128, 256, n):
        attn = get_method("snapkv").open(src, DecodeConfig(budget_tokens=budget))
        attn.attend(0, q, d ** -0.5)
        attn.query_done(_own(src), n + 6)
        out, _ = attn.attend(0, step, d ** -0.5)
        errs.append(rel_l1(out, ref))
        report = attn.read_report()
        assert report.tokens_per_step == [n * hkv, min(budget, n) * hkv]  # query step: all; then the kept set
        assert report.once_kv_bytes == 0  # the query step's read of the prefix is in its step, not charged again
        assert report.step_bytes + report.once_bytes == (n + min(budget, n)) * hkv * src.layout.token_kv_bytes()
    assert errs[-1] < 1e-5, errs
    for small, big in zip(errs, errs[1:]):
        assert big <= small * 1.02 + 1e-4, errs
    assert errs[0] > 10 * errs[-1] + 1e-3, errs


def test_query_picks_the_entries_it_attends() -> None:
    """The kept set holds the needles the query aims at (SnapKV's premise), not just the anchors."""
    kv, q = planted(n=600, d=16, hkv=1, g=1, n_q=4, seed=4)
    k = kv[0][0]
    src = MemorySource.build(kv, ())
    attn = get_method("snapkv").open(src, DecodeConfig(budget_tokens=40, sink=0, tail=0))
    attn.attend(0, q, 0.25)
    attn.query_done(_own(src), 604)
    top = torch.softmax(q[0, 0] @ k[0].T * 0.25, -1).sum(0).topk(5).indices
    assert set(top.tolist()) <= set(attn.kept_ids[0][0].tolist())


def test_greedy_generation_with_covering_budget_equals_full(worker: Worker, lm) -> None:
    pid = worker.prefill(DOC).prefix_id
    n = worker.store.manifest(pid).n_tokens
    runs = {}
    for method, decode in (("full", DecodeConfig()), ("snapkv", DecodeConfig(budget_tokens=n)),
                           ("snapkv", DecodeConfig(budget_tokens=24))):
        st = GenerationStats()
        list(worker.generate(pid, " What is the code?", SamplingParams(max_new_tokens=12), method=method,
                             decode=decode, stats=st))
        runs[(method, decode.budget_tokens)] = st
    full, covering, small = runs[("full", None)], runs[("snapkv", n)], runs[("snapkv", 24)]
    assert covering.token_ids == full.token_ids
    units = lm.layout.n_layers * lm.layout.n_kv_heads
    assert small.prefix_tokens_per_step == [n * units] + [24 * units] * (small.steps - 1)
    assert small.extra["kept_tokens_per_head"] == 24
    # the prefix is read once, by the query step (counted there), then only the kept entries
    assert small.bytes_fetched == sum(small.prefix_tokens_per_step) * lm.layout.token_kv_bytes()
    assert small.bytes_fetched == (n + 24 * (small.steps - 1)) * units * lm.layout.token_kv_bytes()


def test_a_layer_read_only_for_scoring_is_charged_once() -> None:
    """A layer the scorer reads but no query step attended is charged once as prefix K/V; attended ones are not."""
    n, hkv, d = 300, 2, 16
    kv = random_kv(2, hkv, n, d, seed=3)
    src = MemorySource.build(kv, ())

    def scorer(attn: QueryTimeAttention, own: OwnKV, position: int) -> dict[int, torch.Tensor]:
        return {layer: attn.layer_full(layer)[0].float().norm(dim=-1) for layer in range(2)}

    attn = QueryTimeAttention(src, KeepConfig(budget_tokens=32), observe_query=False, scorer=scorer)
    q = torch.randn(1, hkv, 3, d, generator=torch.Generator().manual_seed(1))
    attn.attend(0, q, d ** -0.5)  # the query step attends layer 0 only
    attn.query_done(_own(src), n + 3)
    report = attn.read_report()
    token_bytes = src.layout.token_kv_bytes()
    assert report.tokens_per_step == [n * hkv]
    assert report.once_kv_bytes == n * hkv * token_bytes  # layer 1, read by the scorer alone
    assert report.step_bytes + report.once_bytes == 2 * n * hkv * token_bytes  # each layer exactly once
