"""RAT+ (decaying memory): Auto loading from local code, and greedy decoding through the product (chunked
prefill into the store, packed engine steps continuing the memory from the stored prefix) equal to a plain
transformers ``generate`` of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lab.tiny_random import TinyLlamaSpec, build_tiny_rat
from store.kvstore import KVStore
from workers.engine import Worker
from workers.model import LoadedModel, load_model
from workers.ratplus import RatForCausalLM, has_decaying_memory, memory_gates, set_memory_cap_scale
from workers.requests import GenerationStats, SamplingParams

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


@pytest.fixture(scope="module")
def rat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_rat(tmp_path_factory.mktemp("models") / "tiny-rat", TinyLlamaSpec(seed=0, never_eos=True))


@pytest.fixture(scope="module")
def rat_lm(rat_dir: Path) -> LoadedModel:
    return load_model(str(rat_dir), page_size=16, progress=False)


@pytest.fixture(scope="module")
def reference(rat_dir: Path):
    return AutoModelForCausalLM.from_pretrained(rat_dir).eval()


@pytest.fixture()
def rat_worker(store: KVStore, rat_lm: LoadedModel) -> Worker:
    return Worker(store, rat_lm, chunk_size=40, progress=False)


def _document(n_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n_words,), generator=g).tolist())


def _reference_ids(reference, lm: LoadedModel, doc: str, query: str, n_new: int) -> list[int]:
    ids = lm.tokenizer(doc).input_ids + lm.tokenizer(query, add_special_tokens=False).input_ids
    out = reference.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                             pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_loads_through_auto_classes(rat_dir: Path, rat_lm: LoadedModel, reference) -> None:
    assert isinstance(reference, RatForCausalLM) and isinstance(rat_lm.model, RatForCausalLM)
    assert has_decaying_memory(rat_lm.model.config)
    assert rat_lm.layout.n_layers == 2 and rat_lm.layout.n_kv_heads == 2
    gates = [layer.self_attn.memory_gate for layer in reference.model.layers]
    assert all(g.weight.abs().max() > 0 for g in gates)  # the saved gates came back (not re-initialised)


def test_memory_changes_the_model(reference) -> None:
    """The gates matter: closing them (g = 0, k̃ = k) changes the logits (so the tests below can fail)."""
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        before = reference(ids).logits
        saved = [layer.self_attn.memory_gate.bias.clone() for layer in reference.model.layers]
        for layer in reference.model.layers:
            layer.self_attn.memory_gate.bias.fill_(-1e4)
        closed = reference(ids).logits
        for layer, b in zip(reference.model.layers, saved, strict=True):
            layer.self_attn.memory_gate.bias.copy_(b)
    assert (before - closed).abs().max() > 1e-2


def test_cap_scale_zero_is_the_plain_model(rat_dir: Path, reference) -> None:
    """The training cap ramp (``cap_scale``): at 0 the memory is off exactly (the plain Llama with the same
    weights), at 1 (the default, what a loaded model has) the open gates change the logits."""
    plain = AutoModelForCausalLM.from_pretrained(rat_dir / "_plain").eval()  # the RAT+ model's Llama weights
    assert not isinstance(plain, RatForCausalLM)
    ids = torch.arange(3, 60)[None]
    try:
        with torch.no_grad():
            set_memory_cap_scale(reference, 0.0)
            off = reference(ids).logits
            set_memory_cap_scale(reference, 1.0)
            full = reference(ids).logits
            base = plain(ids).logits
    finally:
        set_memory_cap_scale(reference, 1.0)  # the module's other tests share this model
    assert torch.equal(off, base)
    assert (full - base).abs().max() > 1e-2


def test_gates_get_gradient_while_the_cap_ramps(reference) -> None:
    """Mid-ramp the gates' parameters get gradient (they learn where to close while the memory opens); at the
    ramp's very start (cap 0) they get none."""
    import copy

    model = copy.deepcopy(reference).train()
    ids = torch.arange(3, 60)[None]
    grads = {}
    for scale in (0.0, 0.3):
        set_memory_cap_scale(model, scale)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        grads[scale] = [(layer.self_attn.memory_gate.weight.grad, layer.self_attn.memory_gate.bias.grad)
                        for layer in model.model.layers]
    assert all(float(w.abs().max()) == 0 and float(b.abs().max()) == 0 for w, b in grads[0.0])
    assert all(float(w.abs().max()) > 0 and float(b.abs().max()) > 0 for w, b in grads[0.3])
    with pytest.raises(ValueError):
        set_memory_cap_scale(model, 1.5)


def test_memory_floor_penalty_opens_gates_below_the_floor_only(reference) -> None:
    """With the gates recording their means, the floor penalty is zero at a floor under every layer's mean gate,
    positive above it, and its gradient raises every gate's bias (descent opens the memory); without a recorded
    forward it refuses."""
    import copy

    from lab.train.objective import memory_floor_penalty

    model = copy.deepcopy(reference).train()
    gates = memory_gates(model, record_mean=True)
    assert len(gates) == len(model.model.layers)
    with pytest.raises(ValueError, match="recorded"):
        memory_floor_penalty(gates, 0.5)
    model(torch.arange(3, 60)[None])
    means = [float(g.last_mean.detach()) for g in gates]  # type: ignore[union-attr]
    assert all(0 < m < 1 for m in means)
    assert float(memory_floor_penalty(gates, min(means) - 1e-3).detach()) == 0.0
    above = max(means) + 0.05
    penalty = memory_floor_penalty(gates, above)
    assert float(penalty.detach()) == pytest.approx(sum((above - m) ** 2 for m in means) / len(means), rel=1e-5)
    penalty.backward()
    # descent raises the biases: every channel of the last layer (no gate downstream of it), and each layer's
    # channels together (an earlier layer's bias also moves the later layers' inputs, hence their gates)
    assert float(gates[-1].bias.grad.max()) < 0  # type: ignore[union-attr]
    assert all(float(g.bias.grad.sum()) < 0 for g in gates)  # type: ignore[union-attr]
    assert memory_gates(model)[0].last_mean is None and not gates[0].record_mean  # recording off again


# Document lengths straddle page (16) and prefill-chunk (40) boundaries.
@pytest.mark.parametrize(("n_words", "seed", "query"), [(2, 0, "?"), (9, 1, " which one"), (30, 2, " last:")])
def test_greedy_equals_transformers_generate(rat_worker: Worker, rat_lm: LoadedModel, reference, n_words: int,
                                            seed: int, query: str) -> None:
    doc = _document(n_words, seed)
    n_new = 12
    pre = rat_worker.prefill(doc)
    stats = GenerationStats()
    list(rat_worker.generate(pre.prefix_id, query, SamplingParams(max_new_tokens=n_new), stats=stats, raw=True))
    assert stats.token_ids == _reference_ids(reference, rat_lm, doc, query, n_new)


def test_packed_generations_each_continue_their_own_memory(rat_worker: Worker, rat_lm: LoadedModel,
                                                           reference) -> None:
    """Two generations over different prefixes share engine steps (a query chunk beside a decoding token)."""
    docs, queries, n_new = [_document(25, 5), _document(12, 6)], [" first", " a much longer second query"], 10
    stats = [GenerationStats(), GenerationStats()]
    streams = [rat_worker.generate(rat_worker.prefill(d).prefix_id, q, SamplingParams(max_new_tokens=n_new),
                                   stats=s, raw=True) for d, q, s in zip(docs, queries, stats, strict=True)]
    live = list(streams)
    while live:
        for s in list(live):
            if next(s, None) is None:
                live.remove(s)
    assert max(stats[0].extra.get("batch_max", 1), stats[1].extra.get("batch_max", 1)) == 2
    for d, q, s in zip(docs, queries, stats, strict=True):
        assert s.token_ids == _reference_ids(reference, rat_lm, d, q, n_new)


@pytest.mark.parametrize("method", ["full", "quest"])
def test_static_steps_continue_each_members_memory(store: KVStore, rat_lm: LoadedModel, reference,
                                                   method: str) -> None:
    """The engine's whole-step path (static inputs, as a CUDA graph replays them; run eagerly here) serves a
    model with a decaying memory: each member continues its own memory from its last own token, read on the
    device, and the tokens equal the packed step's (and, for full attention, transformers' ``generate``)."""
    from workers.decode_batch import EngineConfig
    from workers.engine import drain_together
    from workers.requests import DecodeConfig

    docs, queries, n_new = [_document(25, 5), _document(12, 6)], [" first", " a much longer second query"], 10
    got: dict[str, list[list[int]]] = {}
    for whole_step in ("off", "eager"):
        w = Worker(store, rat_lm, chunk_size=40, progress=False, offload=None,
                   engine=EngineConfig(whole_step=whole_step))  # type: ignore[arg-type]
        stats = [GenerationStats(), GenerationStats()]
        drain_together([w.generate(w.prefill(d).prefix_id, q, SamplingParams(max_new_tokens=n_new), method=method,
                                   decode=DecodeConfig(budget=None if method == "full" else 0.5), stats=s)
                        for d, q, s in zip(docs, queries, stats, strict=True)])
        got[whole_step] = [s.token_ids for s in stats]
        if whole_step == "eager":
            graphs = w.engine._graphs
            assert graphs is not None and graphs.replays >= 5  # the static path really ran
            assert all(s.extra["graph_steps"] >= 5 for s in stats)
    assert got["eager"] == got["off"]
    if method == "full":
        assert got["eager"] == [_reference_ids(reference, rat_lm, d, q, n_new) for d, q in zip(docs, queries)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_steps_continue_each_members_memory(store: KVStore, rat_dir: Path) -> None:
    """On CUDA the whole step of a model with a decaying memory is captured and replayed (nothing it reads is
    copied from the host during capture) and gives the eager engine's tokens."""
    from workers.decode_batch import EngineConfig
    from workers.engine import drain_together

    lm = load_model(str(rat_dir), device="cuda", dtype="bfloat16", page_size=16, progress=False)
    docs, queries, n_new = [_document(25, 5), _document(12, 6)], [" first", " a much longer second query"], 12
    got = []
    for graphs_on in (False, True):
        w = Worker(store, lm, progress=False, offload=None, engine=EngineConfig(cuda_graphs=graphs_on))
        stats = [GenerationStats(), GenerationStats()]
        drain_together([w.generate(w.prefill(d).prefix_id, q, SamplingParams(max_new_tokens=n_new), stats=s)
                        for d, q, s in zip(docs, queries, stats, strict=True)])
        got.append([s.token_ids for s in stats])
        if graphs_on:
            graphs = w.engine._graphs
            assert graphs is not None and graphs.captures >= 1 and graphs.replays >= 5 and not graphs.failed
    assert got[1] == got[0]
