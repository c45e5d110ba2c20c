"""``DecodeConfig.query_pages="shared"``: a query chunk's tokens attend one set of pages, the pages with the most
upper-bound (Quest) or index (Top-K) mass for any of them; checked against references written from that
definition, by what a chunk reads, and end to end through a worker reading pages from disk."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.auth import ApiKeys
from services.convert import generate_request_from_pb, generate_request_to_pb
from services.gen import kvstash_pb2 as pb
from services.gen import kvstash_pb2_grpc as pb_grpc
from services.grpc_common import ServerConfig
from services.worker_server import WorkerLimits, build_worker_server
from store.errors import InvalidInput
from store.kvstore import KVStore
from tests.services_harness import free_port
from workers.engine import Worker
from workers.methods.key_index import dequantize_keys
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.quest import QuestBounds, QuestSelector
from workers.methods.registry import get_method
from workers.methods.selector import LayerContext
from workers.methods.topk import IndexedTopKSelector, TopK
from workers.model import LoadedModel
from workers.offload import OffloadConfig
from workers.requests import QUERY_PAGES, DecodeConfig, GenerateRequest, GenerationStats, SamplingParams


def test_query_pages_is_validated_and_carried_by_both_wires() -> None:
    with pytest.raises(InvalidInput, match="query_pages") as e:
        DecodeConfig(query_pages="x" * 100_000)
    assert len(str(e.value)) < 200  # a hostile value is not echoed whole
    for mode in QUERY_PAGES:
        req = GenerateRequest(prefix_id="0" * 32, query="q", method="quest", decode=DecodeConfig(query_pages=mode))
        assert GenerateRequest.from_json(req.prefix_id, req.to_json()).decode.query_pages == mode
        msg = generate_request_to_pb(req)
        assert msg.HasField("query_pages") == (mode != QUERY_PAGES[0])  # the default is left unset
        assert generate_request_from_pb(msg).decode.query_pages == mode
    with pytest.raises(InvalidInput, match="query_pages"):
        generate_request_from_pb(pb.GenerateRequest(prefix_id="0" * 32, query="q", query_pages="some"))
    with pytest.raises(InvalidInput, match="query_pages"):
        GenerateRequest.from_json("0" * 32, {"query": "q", "query_pages": "some"})


def test_the_worker_server_decodes_with_the_query_pages_asked(worker: Worker, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A remote generation's ``query_pages`` reaches ``Worker.generate`` (and the default when unset)."""
    cfg = ServerConfig(port=free_port())
    server, _ = build_worker_server(worker, cfg, ApiKeys(), WorkerLimits())
    server.start()
    try:
        pid = worker.prefill("A short memo about the vault. " * 8).prefix_id
        seen: list[str] = []
        real = worker.generate

        def spy(*a: object, **k: object) -> object:
            seen.append(k["decode"].query_pages)  # type: ignore[union-attr]
            return real(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(worker, "generate", spy)
        stub = pb_grpc.WorkerStub(grpc.insecure_channel(cfg.address))
        for mode in (*QUERY_PAGES, None):
            fields = {} if mode is None else {"query_pages": mode}
            events = list(stub.Generate(pb.GenerateRequest(prefix_id=pid, query="q", method="quest", budget=0.5,
                                                           max_new_tokens=2, **fields), timeout=60))
            assert events[-1].HasField("done")
        assert seen == [*QUERY_PAGES, QUERY_PAGES[0]]
    finally:
        server.stop(0)


def _top_ids(mass: torch.Tensor, n: int) -> list[list[int]]:
    """Per row of ``[H, U]``: the ``n`` highest, ties to the lower id, ascending."""
    return [sorted(sorted(range(row.numel()), key=lambda u: (-float(row[u]), u))[:n]) for row in mass]


def _quest_reference(k: torch.Tensor, q: torch.Tensor, scale: float, page: int, lo: int, hi: int,
                     n: int) -> list[list[int]]:
    """float64 from the definition: each page's bound max(q k) <= sum_d max(q_d kmax_d, q_d kmin_d); each row's
    group-mean softmax over the pages overlapping [lo, hi); per page its largest share over the rows; top n."""
    hkv, n_tok, d = k.shape
    p0, p1 = lo // page, (hi - 1) // page + 1
    kmax = torch.stack([k[:, u * page:min(n_tok, (u + 1) * page)].amax(1) for u in range(p0, p1)], 1).double()
    kmin = torch.stack([k[:, u * page:min(n_tok, (u + 1) * page)].amin(1) for u in range(p0, p1)], 1).double()
    qd = q.double()[..., None, :]  # [T, Hkv, G, 1, D]
    ub = torch.maximum(qd * kmax[None, :, None], qd * kmin[None, :, None]).sum(-1) * scale  # [T, Hkv, G, U]
    mass = torch.softmax(ub, -1).mean(2).amax(0)  # [Hkv, U]
    return [[u + p0 for u in row] for row in _top_ids(mass, n)]


@pytest.mark.parametrize(("n_tok", "g", "lo", "hi", "n"), [
    (320, 1, 4, 300, 3),   # MHA
    (333, 2, 9, 317, 5),   # GQA 2, partial first and last pages
    (512, 4, 16, 496, 8),  # GQA 4
    (100, 2, 4, 90, 40),   # more pages asked than there are
])
def test_quest_shared_pages_equal_a_float64_reference(n_tok: int, g: int, lo: int, hi: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n_tok + g)
    hkv, d, t, page = 2, 16, 5, 16
    k = torch.randn(hkv, n_tok, d, generator=gen)
    q = torch.randn(t, hkv, g, d, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(hkv, d, generator=gen), dim=-1)
    planted = ((lo + hi) // 2) // page * page
    k[:, planted:planted + page] += 6 * u[:, None]  # one page along u, and only the third query token along u
    q[2] = 4 * d ** 0.5 * u[:, None]
    b = QuestBounds().summarize(0, k, k)
    sel = QuestSelector({"0.kmin": b["kmin"], "0.kmax": b["kmax"], "0.meta": b["meta"]})
    ctx = LayerContext(ResidentKV(k, k, page_size=page), lo, hi)
    got = sel.select_pages_shared(0, ctx, q, d ** -0.5, n)
    assert got.tolist() == _quest_reference(k, q, d ** -0.5, page, lo, hi, n)
    # the page the third token points at is in the shared set, though the other tokens do not favour it
    assert all(planted // page in row for row in got.tolist())


def test_topk_shared_pages_equal_the_pooled_page_mass_of_the_index() -> None:
    gen = torch.Generator().manual_seed(3)
    hkv, n_tok, d, g, t, page, lo, hi, n = 2, 640, 32, 2, 4, 16, 4, 620, 6
    k = torch.randn(hkv, n_tok, d, generator=gen)
    q = torch.randn(t, hkv, g, d, generator=gen)
    src = MemorySource.build([(k, k)], TopK.summarizers)
    sel = get_method("topk").selector(src, DecodeConfig())
    assert isinstance(sel, IndexedTopKSelector) and sel.page_size == page
    ctx = LayerContext(ResidentKV(k, k, page_size=page), lo, hi)
    got = sel.select_pages_shared(0, ctx, q, d ** -0.5, n)
    # reference: the index's keys decoded in float64, each token's group-mean softmax over the mid tokens, summed
    # per page, the largest over the query tokens, top n
    idx = sel.index
    keys = dequantize_keys(idx["0.codes"], idx["0.lo"], idx["0.step"], sel.bits, sel.block).double()
    logits = torch.einsum("thgd,hnd->thgn", q.double(), keys[:, lo:hi]) * d ** -0.5
    mass = torch.zeros(t, hkv, n_tok, dtype=torch.float64)
    mass[..., lo:hi] = torch.softmax(logits, -1).mean(2)
    p0, p1 = lo // page, (hi - 1) // page + 1
    pages = mass[..., p0 * page:p1 * page].reshape(t, hkv, p1 - p0, page).sum(-1).amax(0)
    assert got.tolist() == [[u + p0 for u in row] for row in _top_ids(pages, n)]


@pytest.mark.parametrize("method", ["quest", "topk", "quest+phi", "topk+phi"])
def test_a_query_chunk_reads_one_budget_of_pages_when_shared(method: str) -> None:
    """A chunk of 8 query tokens: each token's own pages read several budgets; shared, one budget (the same as a
    decode step); a decode step after it is the same either way."""
    gen = torch.Generator().manual_seed(5)
    hkv, n_tok, d, layers = 2, 2000, 32, 2
    kv = [(torch.randn(hkv, n_tok, d, generator=gen), torch.randn(hkv, n_tok, d, generator=gen))
          for _ in range(layers)]
    chunk = torch.randn(1, 2 * hkv, 8, d, generator=gen)
    step = torch.randn(1, 2 * hkv, 1, d, generator=gen)
    reads, outs = {}, {}
    for mode in ("token", "shared"):
        src = MemorySource.build(kv, get_method(method).summarizers)
        attn = get_method(method).open(src, DecodeConfig(budget=0.05, query_pages=mode))
        for x in (chunk, step):
            for layer in range(layers):
                out, _ = attn.attend(layer, x, d ** -0.5)
        reads[mode] = attn.read_report().tokens_per_step
        outs[mode] = out
    decode_step = reads["shared"][1]  # what one token's pages are
    assert reads["shared"][0] == decode_step
    assert reads["token"][0] > 2 * decode_step
    assert reads["token"][1] == decode_step
    assert torch.equal(outs["token"], outs["shared"])


def test_shared_query_pages_read_fewer_pages_from_disk(store: KVStore, lm: LoadedModel) -> None:
    """Through the worker, pages from the page files (no host tier): a shared selection reads fewer pages before
    the first token, and both generations finish."""
    doc = " ".join(f"item {i} is {i * 7 % 101}." for i in range(180))
    pid = Worker(store, lm, progress=False).prefill(doc).prefix_id
    ssd = {}
    for mode in ("token", "shared"):
        w = Worker(store, lm, progress=False, offload=OffloadConfig(host_cache_bytes=0, warm_host_fraction=0.0))
        st = GenerationStats()
        text = "".join(w.generate(pid, "What is item 123? And what is item 32?", SamplingParams(max_new_tokens=1),
                                  method="quest", decode=DecodeConfig(budget=0.05, query_pages=mode), stats=st))
        assert st.new_tokens == 1 and isinstance(text, str)
        ssd[mode] = st.extra["offload_ssd_pages"]
    assert 0 < ssd["shared"] < ssd["token"] / 2


def test_methods_picking_tokens_or_blocks_keep_each_tokens_own() -> None:
    """MoBA picks blocks through ``select``, not whole-page steps: ``shared`` leaves its chunk as it is."""
    gen = torch.Generator().manual_seed(6)
    kv = [(torch.randn(2, 2000, 32, generator=gen), torch.randn(2, 2000, 32, generator=gen))]
    chunk = torch.randn(1, 4, 8, 32, generator=gen)
    got = {}
    for mode in ("token", "shared"):
        attn = get_method("moba").open(MemorySource.build(kv, get_method("moba").summarizers),
                                       DecodeConfig(budget=0.05, query_pages=mode))
        got[mode] = (attn.attend(0, chunk, 32 ** -0.5)[0], attn.read_report().tokens_per_step)
    assert torch.equal(got["token"][0], got["shared"][0]) and got["token"][1] == got["shared"][1]
