"""The recall tier (kvzip+quest): attention over the kept cache and the recalled evicted tokens against an
independent float64 reference, its read accounting, and the method through the worker and the embedded client."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.kvclient import KVClient
from store.kvstore import KVStore
from workers.engine import Worker
from workers.methods.compressed import CompressedPrefixAttention, compact_cache
from workers.methods.memory import MemorySource
from workers.methods.recall import KVzipQuest, RecallPrefixAttention
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

PAGE = 16
DOC = ("The vault code for the north wing is 4417. The cat sleeps on the warm stones by the river. "
       "Bread is baked before dawn in the old mill. The vault code for the south wing is 9023. ") * 3
QUERY = "What is the vault code for the north wing?"


def _setup(n_tokens: int = 70, n_pages: int = 2, seed: int = 0
           ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, RecallPrefixAttention]:
    gen = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(2, n_tokens, 16, generator=gen), torch.randn(2, n_tokens, 16, generator=gen))
          for _ in range(2)]
    keep = torch.rand(2, 2, n_tokens, generator=gen) < 0.3
    keep[1, 1] = False  # a head that keeps nothing: every page is a candidate
    keep[0, 1, :PAGE] = True  # a page that evicts nothing: never recalled
    src = MemorySource(kv, {}, page_size=PAGE)
    cache = compact_cache(keep, kv)
    bounds = KVzipQuest().derive(cache, kv, PAGE)
    return kv, keep, RecallPrefixAttention(src, CompressedPrefixAttention(src, cache), cache, bounds, n_pages)


def _reference_pages(k: torch.Tensor, evict: torch.Tensor, q: torch.Tensor, scale: float, n: int) -> list[int]:
    """Quest over the evicted keys, page by page in float64: the group's mean softmax of per-page upper bounds."""
    bounds = []
    for start in range(0, k.shape[0], PAGE):
        e = evict[start:start + PAGE]
        if not e.any():
            bounds.append(torch.full((q.shape[0],), float("-inf"), dtype=torch.float64))
            continue
        ks = k[start:start + PAGE][e].double()
        hi, lo = ks.amax(0), ks.amin(0)
        bounds.append(torch.maximum(q.double() * hi, q.double() * lo).sum(-1) * scale)  # [G]
    mass = torch.softmax(torch.stack(bounds, dim=-1), dim=-1).nan_to_num(0.0).mean(0)
    ranked = [int(p) for p in torch.argsort(mass, descending=True) if mass[p] > 0]
    return ranked[:n]


def _reference(k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor, q: torch.Tensor, scale: float,
               n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Float64 softmax attention of one KV head's query group ``q [G, D]`` over kept ∪ recalled tokens."""
    pages = _reference_pages(k, ~kept, q, scale, n)
    use = kept.clone()
    for p in pages:
        use[p * PAGE:(p + 1) * PAGE] |= ~kept[p * PAGE:(p + 1) * PAGE]
    logits = q.double() @ k[use].double().T * scale
    lse = torch.logsumexp(logits, -1)
    return torch.exp(logits - lse[:, None]) @ v[use].double(), lse, pages


@pytest.mark.parametrize("n_pages", [1, 2, 3, 5])
def test_recall_is_attention_over_the_kept_and_the_recalled_evicted_tokens(n_pages: int) -> None:
    kv, keep, attn = _setup(n_pages=n_pages)
    q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(9))
    recalled = 0
    for layer, (k, v) in enumerate(kv):
        out, lse = attn.attend(layer, q, 0.25)
        for t in range(3):
            for h in range(2):
                ref, ref_lse, pages = _reference(k[h], v[h], keep[layer, h], q[0, 2 * h:2 * h + 2, t], 0.25, n_pages)
                torch.testing.assert_close(out[0, 2 * h:2 * h + 2, t].double(), ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse[0, 2 * h:2 * h + 2, t].double(), ref_lse, rtol=1e-5, atol=1e-5)
                recalled += len(pages)
    assert recalled > 0


def test_a_budget_over_every_page_is_full_attention() -> None:
    kv, _, attn = _setup(n_pages=5)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    for layer, (k, v) in enumerate(kv):
        out, lse = attn.attend(layer, q, 0.25)
        for h in range(2):
            logits = q[0, 2 * h:2 * h + 2, 0].double() @ k[h].double().T * 0.25
            ref = torch.softmax(logits, -1) @ v[h].double()
            torch.testing.assert_close(out[0, 2 * h:2 * h + 2, 0].double(), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[0, 2 * h:2 * h + 2, 0].double(), torch.logsumexp(logits, -1))


def test_reads_are_the_kept_tokens_plus_whole_recalled_pages_per_step() -> None:
    kv, keep, attn = _setup(n_pages=2)
    gen = torch.Generator().manual_seed(4)
    expect = []
    for _ in range(3):  # three single-row steps
        q = torch.randn(1, 4, 1, 16, generator=gen)
        pages = 0
        for layer, (k, _) in enumerate(kv):
            attn.attend(layer, q, 0.25)
            for h in range(2):
                pages += len(_reference_pages(k[h], ~keep[layer, h], q[0, 2 * h:2 * h + 2, 0], 0.25, 2))
        expect.append(int(keep.sum()) + pages * PAGE)
    report = attn.read_report()
    assert report.tokens_per_step == expect
    assert report.step_bytes == sum(expect) * attn.source.layout.token_kv_bytes()
    positions = sum(4 * (int(keep[layer].sum()) + 2) for layer in range(2))  # int32 positions + head counts
    assert report.once_bytes == positions


def _answer(worker: Worker, pid: str, method: str, ratio: float | None = None,
            budget: float | None = None) -> GenerationStats:
    stats = GenerationStats()
    "".join(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=8), method=method,
                            decode=DecodeConfig(ratio=ratio, budget=budget), stats=stats))
    return stats


def test_worker_builds_bounds_beside_kvzips_cache_and_counts_every_read(worker: Worker, store: KVStore) -> None:
    pid = worker.prefill(DOC).prefix_id
    full = _answer(worker, pid, "full")
    zipped = _answer(worker, pid, "kvzip", 0.1)
    assert (worker.compressions.scorings, worker.compressions.builds) == (1, 1)
    everything = _answer(worker, pid, "kvzip+quest", 0.1, 1.0)  # recalls every evicted page: full attention
    assert everything.token_ids == full.token_ids
    assert (worker.compressions.scorings, worker.compressions.builds) == (1, 2)  # kvzip's cache reused
    names = {x.name for x in store.manifest(pid).artifacts}
    assert {"kvzip.r0.1000.v1", "kvzip+quest.r0.1000.v1"} <= names
    some = _answer(worker, pid, "kvzip+quest", 0.1, 0.1)
    assert worker.compressions.builds == 2
    lay = worker.lm.layout
    kept = zipped.prefix_tokens_per_step[0]
    n_pages = int(0.1 * store.manifest(pid).n_tokens) // lay.page_size
    decode = some.prefix_tokens_per_step[1:]  # after the query's forward (its rows' pages together): one row a step
    assert all(kept < n <= kept + n_pages * lay.page_size * lay.n_layers * lay.n_kv_heads for n in decode)
    assert some.extra["once_bytes_summaries"] > 0 and some.extra["offload_pages_requested"] > 0
    # What the tiers moved (whole pages) is what the counter counted, plus the bounds and kept positions once.
    assert some.bytes_fetched == sum(some.prefix_tokens_per_step) * lay.token_kv_bytes() + int(
        some.extra["once_bytes_summaries"] + some.extra["once_bytes_kept_positions"])


def test_kvzip_quest_through_the_embedded_client(tmp_path: Path, tiny_model_dir: Path) -> None:
    client = KVClient(home=tmp_path / "home", model=str(tiny_model_dir), device="cpu", progress=False)
    h = client.prefill(DOC)
    full = client.generate(QUERY, prefix=h, max_new_tokens=8)
    recalled = client.generate(QUERY, prefix=h, method="kvzip+quest", ratio=0.1, budget=1.0, max_new_tokens=8)
    assert recalled.text == full.text and recalled.stats.token_ids == full.stats.token_ids
    small = client.generate(QUERY, prefix=h, method="kvzip+quest", ratio=0.1, budget=0.05, max_new_tokens=8)
    small.text  # noqa: B018 - runs the generation to the end
    assert 0.1 <= small.stats.bytes_fetched / small.stats.bytes_full < 0.5
