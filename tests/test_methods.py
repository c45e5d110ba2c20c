"""One test matrix over every registered decode method, each case a numeric property.

- (a) With a budget covering every entry, ``attend`` equals exact attention: out within
  ``atol=rtol=1e-5`` and lse within ``1e-5`` (fp32 inputs; the sparse path and the dense reference
  compute in float32 on the CPU), for multi-token calls, GQA, and anchors that differ
  from the ones the summaries were built with. Greedy generation through the Worker then emits
  exactly the tokens of the "full" method.
- (b) On planted data, attention error against full falls as the budget grows and vanishes
  at full budget; reads per step never exceed the matched budget ``n(f)``.
"""

from __future__ import annotations

import pytest
import torch

from workers.attention import dense_attention
from workers.budget import plan_budget
from workers.engine import Worker
from workers.methods.base import ReportsReads
from workers.methods.memory import MemorySource
from workers.methods.registry import METHODS, NEEDS_ADAPTER, QUERY_TIME, compression_methods, get_method
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

ALL = sorted(set(METHODS) - NEEDS_ADAPTER - set(compression_methods()))
"""Methods that decode the stored prefix itself and need no trained parts (LookaheadKV: tests/test_lookahead.py;
compressed caches: tests/test_compressed.py)."""
SPARSE = [m for m in ALL if m != "full" and m not in QUERY_TIME]
"""Budget-fraction methods (query-time caches' cases: tests/test_query_time_cache.py)."""
ATOL = RTOL = 1e-5


def random_kv(n_layers: int, hkv: int, n: int, d: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)) for _ in range(n_layers)]


def planted(n: int, d: int, hkv: int, g: int, n_q: int, seed: int) -> tuple[list, torch.Tensor]:
    """Keys with a few needles per query head plus a diffuse background; queries aimed at them."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    q = torch.randn(1, hkv * g, n_q, d, generator=gen) * 0.5
    for h in range(hkv * g):
        needles = torch.randint(4, n - 16, (6,), generator=gen)
        q[0, h] += 1.5 * k[h // g, needles].mean(0)
    return [(k, v)], q


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref).abs().sum(-1) / (ref.abs().sum(-1) + 1e-9)).mean())


@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize(("n", "g", "sink", "tail", "l"), [
    (203, 2, 4, 16, 1),
    (203, 4, 4, 16, 3),   # multi-token call, GQA 4
    (150, 1, 9, 3, 2),    # anchors differ from the ones summaries were built with
    (17, 2, 4, 16, 1),    # shorter than sink + tail: no mid region
])
def test_full_budget_equals_exact_attention(method: str, n: int, g: int, sink: int, tail: int, l: int) -> None:
    hkv, d = 2, 16
    kv = random_kv(2, hkv, n, d, seed=n + g)
    src = MemorySource.build(kv, METHODS[method].summarizers)
    attn = get_method(method).open(src, DecodeConfig(budget=1.0, sink=sink, tail=tail))
    q = torch.randn(1, hkv * g, l, d, generator=torch.Generator().manual_seed(1)) * 2
    for layer, (k, v) in enumerate(kv):
        out, lse = attn.attend(layer, q, d ** -0.5)
        ref, ref_lse = dense_attention(q, k[None], v[None], d ** -0.5)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", SPARSE)
def test_multi_token_call_selects_per_query_token(method: str) -> None:
    """A call with L query tokens equals L single-token calls (each token picks its own entries)."""
    kv, q = planted(n=400, d=16, hkv=2, g=2, n_q=4, seed=3)
    src = MemorySource.build(kv, METHODS[method].summarizers)
    cfg = DecodeConfig(budget=0.15)
    joint, _ = get_method(method).open(src, cfg).attend(0, q, 0.25)
    single = get_method(method).open(src, cfg)
    parts = torch.cat([single.attend(0, q[:, :, i:i + 1], 0.25)[0] for i in range(q.shape[2])], dim=2)
    torch.testing.assert_close(joint, parts, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("fraction", [0.05, 0.3, 1.0])
def test_single_row_step_counts_reads_like_marking(method: str, fraction: float) -> None:
    """A one-token step counts its reads without marking: the same count as two rows of that token."""
    kv, q = planted(n=403, d=16, hkv=2, g=2, n_q=1, seed=9)
    src = MemorySource.build(kv, METHODS[method].summarizers)
    cfg = DecodeConfig(budget=fraction, sink=2, tail=4, gen_len=256)  # φ plans feasible at 5 % of a short prefix
    one = get_method(method).open(src, cfg)
    one.attend(0, q, 0.25)
    two = get_method(method).open(src, cfg)
    two.attend(0, q.expand(-1, -1, 2, -1), 0.25)
    assert isinstance(one, ReportsReads) and isinstance(two, ReportsReads)
    assert one.read_report().tokens_per_step == two.read_report().tokens_per_step


@pytest.mark.parametrize("method", SPARSE)
def test_error_falls_as_budget_grows(method: str) -> None:
    kv, q = planted(n=1000, d=32, hkv=2, g=4, n_q=6, seed=11)
    k, v = kv[0]
    ref, _ = dense_attention(q, k[None], v[None], 32 ** -0.5)
    src = MemorySource.build(kv, METHODS[method].summarizers)
    errs = []
    for f in (0.05, 0.1, 0.2, 0.4, 1.0):
        out, _ = get_method(method).open(src, DecodeConfig(budget=f)).attend(0, q, 32 ** -0.5)
        errs.append(rel_l1(out, ref))
    assert errs[-1] < 1e-5, errs
    for small, big in zip(errs, errs[1:]):
        assert big <= small * 1.02 + 1e-4, errs
    assert errs[0] > 10 * errs[-1] + 1e-3, errs  # the smallest budget is a real approximation


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("fraction", [0.05, 0.12, 0.3])
def test_reads_per_step_fit_the_matched_budget(method: str, fraction: float) -> None:
    """Exact reads + the φ offset per layer, KV head and single-token step never exceed n(f)."""
    n, hkv, d = 700, 2, 16
    kv, q = planted(n=n, d=d, hkv=hkv, g=2, n_q=1, seed=5)
    src = MemorySource.build(kv, METHODS[method].summarizers)
    attn = get_method(method).open(src, DecodeConfig(budget=fraction))
    attn.attend(0, q, d ** -0.5)
    assert isinstance(attn, ReportsReads)
    report = attn.read_report()
    phi = method.endswith("+phi")
    plan = plan_budget(prefill_len=n, fraction=fraction, head_dim=d, phi_dim=d if phi else 0)
    per_head = report.tokens_per_step[0] / hkv
    assert per_head + (plan.n_off if phi else 0) <= plan.n_budget
    if method.startswith(("topk-exact", "topk-token")):  # token-granular top-k fills its budget exactly
        assert per_head == plan.sink + plan.tail + plan.k_exact(phi)
    key_only = report.extra["selection_keys_per_step"]  # the token-granular indexed Top-K's shortlist beyond its picks
    assert key_only == (hkv * plan.k_exact(phi) if method == "topk-token" else 0)
    index = report.extra["index_bytes"]  # summaries selection scanned this step (Double-P's centroids)
    assert (index > 0) == method.startswith("doublep")
    assert report.step_bytes == (report.tokens_per_step[0] * src.layout.token_kv_bytes()
                                 + key_only * src.layout.token_kv_bytes() // 2 + index)


DOC = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november " * 6
       + "The code is 4711.")


@pytest.fixture(scope="module")
def full_run(lm, tmp_path_factory) -> tuple[list[int], str]:
    from store.config import StoreConfig
    from store.kvstore import KVStore

    store = KVStore(StoreConfig(home=tmp_path_factory.mktemp("h"), page_size=lm.layout.page_size))
    w = Worker(store, lm, progress=False)
    pid = w.prefill(DOC).prefix_id
    st = GenerationStats()
    list(w.generate(pid, " What is the code?", SamplingParams(max_new_tokens=12), stats=st))
    store.close()
    return st.token_ids, pid


@pytest.mark.parametrize("method", SPARSE)
def test_greedy_generation_with_full_budget_equals_full(worker: Worker, lm, full_run, method: str) -> None:
    pid = worker.prefill(DOC).prefix_id
    st = GenerationStats()
    list(worker.generate(pid, " What is the code?", SamplingParams(max_new_tokens=12), method=method,
                         decode=DecodeConfig(budget=1.0), stats=st))
    assert st.token_ids == full_run[0]
    everything = worker.store.manifest(pid).n_tokens * lm.layout.n_layers * lm.layout.n_kv_heads
    assert st.prefix_tokens_per_step == [everything] * st.steps


@pytest.mark.parametrize("method", SPARSE)
def test_sparse_generation_reads_less_than_full(worker: Worker, lm, method: str) -> None:
    pid = worker.prefill(DOC).prefix_id
    runs = {}
    for name, budget in (("full", None), (method, 0.1)):
        st = GenerationStats()
        list(worker.generate(pid, " code?", SamplingParams(max_new_tokens=6), method=name,
                             decode=DecodeConfig(budget=budget), stats=st))
        runs[name] = st
    sparse, full = runs[method], runs["full"]
    assert sparse.steps >= 1 and len(sparse.prefix_tokens_per_step) == sparse.steps
    assert max(sparse.prefix_tokens_per_step) < full.prefix_tokens_per_step[0]
    step_bytes = sum(sparse.prefix_tokens_per_step) * lm.layout.token_kv_bytes()
    assert sparse.bytes_fetched >= step_bytes and sparse.extra["token_equiv_per_step"] > 0
