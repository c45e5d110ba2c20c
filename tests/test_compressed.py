"""Compressed caches (KVzip, HybridKV, StreamingLLM): the reconstruction score against an independent
float64 reference, keep sets, decode over the compact cache, building once per (prefix, method, ratio)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from store.errors import InvalidInput
from store.kvstore import KVStore
from workers.compression import TOKENS_ARTIFACT, tokens_from_bytes
from workers.engine import Worker
from workers.kernels.dense_attention import dense_attention_ref
from workers.methods.compressed import CompressedPrefixAttention, compact_cache, top_global
from workers.methods.compressed_names import cache_artifact, parse_cache_artifact
from workers.methods.head_scores import HeadScores
from workers.methods.hybridkv import HybridKV
from workers.methods.memory import MemorySource
from workers.methods.reconstruct import ReconstructConfig, reconstruction_inputs, reconstruction_scores
from workers.methods.streamingllm import StreamingLLM
from workers.model import LoadedModel
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

DOC = ("The vault code for the north wing is 4417. The cat sleeps on the warm stones by the river. "
       "Bread is baked before dawn in the old mill. The vault code for the south wing is 9023. ") * 3
QUERY = "What is the vault code for the north wing?"


def _answer(worker: Worker, pid: str, method: str, ratio: float | None = None) -> GenerationStats:
    stats = GenerationStats()
    "".join(worker.generate(pid, QUERY, SamplingParams(max_new_tokens=8), method=method,
                            decode=DecodeConfig(ratio=ratio), stats=stats))
    return stats


def _reference_scores(lm: LoadedModel, ids: list[int], chunk: int) -> torch.Tensor:
    """Float64, eager attention over the whole sequence context + prompt + chunk, one chunk at a time:
    the max attention probability each context key gets from the chunk's rows, over a KV head's query heads."""
    model = copy.deepcopy(lm.model).double()
    model.set_attn_implementation("eager")
    prompt, repeat = reconstruction_inputs(lm, ids)
    n, lay = len(ids), lm.layout
    g = model.config.num_attention_heads // lay.n_kv_heads
    best = torch.zeros(lay.n_layers, lay.n_kv_heads, n, dtype=torch.float64)
    for start in range(0, len(repeat), chunk):
        seq = ids + prompt + repeat[start:start + chunk]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq]), output_attentions=True, use_cache=False)
        for layer, att in enumerate(out.attentions):  # [1, Hq, S, S]
            a = att[0, :, n:, :n].reshape(lay.n_kv_heads, g, -1, n)
            best[layer] = torch.maximum(best[layer], a.amax(dim=(1, 2)))
    return best


def test_reconstruction_score_matches_a_float64_reference(worker: Worker, store: KVStore, lm: LoadedModel) -> None:
    pid = worker.prefill(DOC).prefix_id
    m = store.manifest(pid)
    ids = tokens_from_bytes(store.artifact(pid, TOKENS_ARTIFACT))
    kv = [store.read_layer(pid, layer, manifest=m) for layer in range(lm.layout.n_layers)]
    cfg = ReconstructConfig(chunk_tokens=37, max_score_elems=4096)  # several chunks, several row blocks each
    got = reconstruction_scores(lm, ids, kv, config=cfg)
    ref = _reference_scores(lm, ids, 37)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)
    assert got.max() > 0.05 and (got > 0).all()
    heads = torch.zeros(lm.layout.n_layers, lm.layout.n_kv_heads, dtype=torch.bool)
    heads[0, 1] = True
    some = reconstruction_scores(lm, ids, kv, heads=heads, config=cfg)  # HybridKV: only the selected heads
    torch.testing.assert_close(some[0, 1], got[0, 1])
    others = some.clone()
    others[0, 1] = 0
    assert not others.any()  # every head but the selected one unscored (exact zeros; a sum's order may round)


def test_global_keep_is_non_uniform_across_heads_and_exact_in_count() -> None:
    scores = torch.rand(3, 2, 50, generator=torch.Generator().manual_seed(0))
    scores[1, 0] += 1.0  # one head matters more
    keep = top_global(scores, 60)
    assert int(keep.sum()) == 60 and int(keep[1, 0].sum()) == 50
    assert scores[keep].min() >= scores[~keep].max()


def test_decode_over_the_compact_cache_is_attention_over_the_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = [(torch.randn(2, 40, 16, generator=gen), torch.randn(2, 40, 16, generator=gen)) for _ in range(2)]
    keep = torch.rand(2, 2, 40, generator=gen) < 0.3
    keep[1, 1] = False  # a head that keeps nothing
    attn = CompressedPrefixAttention(MemorySource(kv, {}), compact_cache(keep, kv))
    q = torch.randn(1, 4, 3, 16, generator=gen)
    for layer, (k, v) in enumerate(kv):
        out, lse = attn.attend(layer, q, 0.25)
        for h in range(2):
            sel = keep[layer, h]
            kh, vh = k[h, sel][None, None], v[h, sel][None, None]
            ref, ref_lse = dense_attention_ref(q[:, 2 * h:2 * h + 2], kh, vh, 0.25)
            torch.testing.assert_close(out[:, 2 * h:2 * h + 2], ref)
            torch.testing.assert_close(lse[:, 2 * h:2 * h + 2], ref_lse)
    assert attn.read_report().tokens_per_step == [int(keep.sum())]


def test_streamingllm_keeps_sinks_and_the_recent_window() -> None:
    keep = StreamingLLM().keep(None, 0.25, 2, 2, 100)
    expect = torch.zeros(100, dtype=torch.bool)
    expect[:4] = True
    expect[79:] = True
    assert (keep == expect).all()


def test_hybridkv_scores_selected_heads_and_prunes_the_rest() -> None:
    ranking = HeadScores(scores=((0.9, 0.1), (0.2, 0.8)), head_fraction=0.5)
    method = HybridKV(ranking)
    assert method.selected().tolist() == [[True, False], [False, True]]
    scores = torch.rand(2, 2, 30, generator=torch.Generator().manual_seed(2))
    keep = method.keep(scores, 0.3, 2, 2, 30)
    assert int(keep.sum()) == 36 and not keep[0, 1].any() and not keep[1, 0].any()
    whole = method.keep(None, 0.75, 2, 2, 30)  # above k: head pruning only, whole heads by the ranking
    assert whole.all(dim=2).tolist() == [[True, False], [True, True]] and int(whole.sum()) == 90
    assert not method.needs_scores(0.75) and method.needs_scores(0.5)
    with pytest.raises(InvalidInput, match="head ranking"):
        HybridKV(None).scores_name()


def test_cache_names_round_trip() -> None:
    name = cache_artifact("kvzip", 0.30000001, 1)
    assert name == "kvzip.r0.3000.v1"
    parsed = parse_cache_artifact(name)
    assert parsed is not None and (parsed.method, parsed.ratio, parsed.version) == ("kvzip", 0.3, 1)
    assert parse_cache_artifact("page_crc") is None and parse_cache_artifact("kvzip.scores.v1") is None


def test_kvzip_at_ratio_one_decodes_like_full(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    full, zipped = _answer(worker, pid, "full"), _answer(worker, pid, "kvzip", 1.0)
    assert zipped.token_ids == full.token_ids
    assert zipped.bytes_fetched == full.bytes_fetched


def test_compression_runs_once_per_ratio_and_scores_once_per_prefix(worker: Worker, store: KVStore) -> None:
    pid = worker.prefill(DOC).prefix_id
    a = _answer(worker, pid, "kvzip", 0.3)
    _answer(worker, pid, "kvzip", 0.3)
    assert (worker.compressions.scorings, worker.compressions.builds) == (1, 1)
    b = _answer(worker, pid, "kvzip", 0.5)  # another ratio: the stored scores, a new compact cache
    assert (worker.compressions.scorings, worker.compressions.builds) == (1, 2)
    names = [x.name for x in store.manifest(pid).artifacts]
    assert {"kvzip.scores.v1", "kvzip.r0.3000.v1", "kvzip.r0.5000.v1"} <= set(names)
    assert a.bytes_fetched / a.bytes_full == pytest.approx(0.3, abs=0.01)  # --stats: what each step reads
    assert b.bytes_fetched / b.bytes_full == pytest.approx(0.5, abs=0.01)
    other = Worker(store, worker.lm, progress=False)  # another worker on the same store uses the stored cache
    _answer(other, pid, "kvzip", 0.3)
    assert (other.compressions.scorings, other.compressions.builds) == (0, 0)


def test_concurrent_first_uses_build_once(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _answer(worker, pid, "streamingllm", 0.4)
            _answer(worker, pid, "kvzip", 0.2)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (worker.compressions.scorings, worker.compressions.builds) == (1, 2)
    assert worker.compressions._flights.in_flight() == 0  # no lock is kept once its builds are done


def test_add_artifact_keeps_the_first_writer(worker: Worker, store: KVStore) -> None:
    pid = worker.prefill(DOC).prefix_id
    first = store.add_artifact(pid, "kvzip.r0.1000.v1", b"first")
    second = store.add_artifact(pid, "kvzip.r0.1000.v1", b"second")
    assert second.artifact("kvzip.r0.1000.v1") == first.artifact("kvzip.r0.1000.v1")
    assert store.artifact(pid, "kvzip.r0.1000.v1") == b"first"
    store.verify(pid)
    report = store.check()  # the directory describes what the metadata says (recovery would register the same)
    assert not report.problems


def test_added_caches_have_room_beyond_the_summaries_budget(worker: Worker, store: KVStore,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ratios of one compressed cache take more than the K/V (0.1 + 0.2 + 0.3 + 0.5 = 1.1 of it): added
    artifacts get twice the page bytes beyond the summaries' budget; past that, a refusal naming the numbers."""
    import store.limits as limits

    monkeypatch.setattr(limits, "MIN_ARTIFACT_BUDGET", 0)  # the floor would hide the bound on a tiny prefix
    pid = worker.prefill(DOC).prefix_id
    m = store.manifest(pid)
    room = limits.max_added_artifact_bytes(m.kv_bytes) - m.artifact_bytes
    assert room >= m.kv_bytes + m.kv_bytes // 10  # the four ratios of one method fit
    m = store.add_artifact(pid, "kvzip.r0.5000.v1", b"a" * (room - 10))
    with pytest.raises(InvalidInput, match=r"does not fit: this prefix's artifacts may take \d+ bytes together"):
        store.add_artifact(pid, "kvzip.r0.1000.v1", b"b" * 11)
    assert store.manifest(pid).artifact("kvzip.r0.1000.v1") is None
    assert store.add_artifact(pid, "kvzip.r0.1000.v1", b"b" * 10).artifact("kvzip.r0.1000.v1") is not None


def test_prefixes_stored_before_tokens_were_kept_get_them_on_the_next_prefill(worker: Worker, store: KVStore) -> None:
    pid = worker.prefill(DOC).prefix_id
    m = store.manifest(pid)
    ids = tokens_from_bytes(store.artifact(pid, TOKENS_ARTIFACT))
    assert ids == worker.tokenize_document(DOC) and m.artifact(TOKENS_ARTIFACT) is not None
