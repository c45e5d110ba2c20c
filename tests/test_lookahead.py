"""LookaheadKV: adapters inactive on ordinary tokens, the adapter file tied to its model, serving on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from store.errors import InvalidInput
from tests.conftest import TEST_PAGE_SIZE
from tests.test_methods import DOC
from workers.engine import Worker
from workers.fingerprint import model_fingerprint
from workers.lookahead_adapter import AdapterMismatch, LookaheadAdapter, LookaheadConfig, save_adapter
from workers.model import LoadedModel, load_model
from workers.offload import OffloadConfig
from workers.requests import DecodeConfig, GenerationStats, SamplingParams

CFG = LookaheadConfig(n_lookahead=6, rank=4, alpha=8.0)


def _randomize(adapter: LookaheadAdapter, seed: int = 3) -> None:
    """Non-zero LoRA B (a fresh adapter is a no-op): the adapters really change what they touch."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.lora_b.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def adapted_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with a (random, untrained) lookahead adapter beside its weights."""
    out = tmp_path_factory.mktemp("adapted") / "tiny-la"
    shutil.copytree(tiny_model_dir, out)
    lm = load_model(str(out), page_size=TEST_PAGE_SIZE, progress=False)
    adapter = LookaheadAdapter(lm.model, CFG, seed=1)
    _randomize(adapter)
    save_adapter(adapter, out, base_fingerprint=lm.fingerprint, info={"steps": 0})
    adapter.detach_hooks()
    return out


@pytest.fixture(scope="module")
def adapted_lm(adapted_dir: Path) -> LoadedModel:
    return load_model(str(adapted_dir), page_size=TEST_PAGE_SIZE, progress=False)


def test_adapter_changes_only_lookahead_positions(lm: LoadedModel) -> None:
    model = lm.model
    ids = torch.tensor([[5, 17, 99, 42, 7, 64, 3]])
    n = ids.shape[1]
    adapter = LookaheadAdapter(model, CFG, seed=2)
    _randomize(adapter)
    try:
        with torch.no_grad():
            emb = torch.cat([model.get_input_embeddings()(ids), adapter.embeddings[None].to(model.dtype)], 1)
            plain = model(inputs_embeds=emb, use_cache=False, output_hidden_states=True)
            mask = torch.zeros(1, emb.shape[1], dtype=torch.bool)
            mask[:, n:] = True
            with adapter.active(mask):
                adapted = model(inputs_embeds=emb, use_cache=False, output_hidden_states=True)
            after = model(inputs_embeds=emb, use_cache=False)  # the adapter is off again outside the block
    finally:
        adapter.detach_hooks()
    for h_plain, h_adapted in zip(plain.hidden_states, adapted.hidden_states, strict=True):
        assert torch.equal(h_plain[:, :n], h_adapted[:, :n])  # ordinary tokens: bit for bit
    assert torch.equal(plain.logits[:, :n], adapted.logits[:, :n])
    assert not torch.allclose(plain.logits[:, n:], adapted.logits[:, n:], atol=1e-3)  # lookahead tokens: changed
    assert torch.equal(after.logits, plain.logits)


def test_adapter_is_folded_into_the_fingerprint(lm: LoadedModel, adapted_lm: LoadedModel, adapted_dir: Path) -> None:
    assert adapted_lm.lookahead is not None and adapted_lm.lookahead.config == CFG
    base = model_fingerprint(adapted_lm.model, str(adapted_dir))
    assert base == lm.fingerprint  # the adapter file is not hashed as a weight file
    assert adapted_lm.fingerprint != lm.fingerprint


def test_adapter_of_another_model_is_refused(adapted_dir: Path, other_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(other_model_dir, other)
    for name in ("lookahead.safetensors", "lookahead.json"):
        shutil.copy(adapted_dir / name, other / name)
    with pytest.raises(AdapterMismatch, match="trained for model fingerprint"):
        load_model(str(other), page_size=TEST_PAGE_SIZE, progress=False)


def test_model_without_adapter_refuses_lookahead(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    with pytest.raises(InvalidInput, match="lookahead.safetensors"):
        worker.generate(pid, " code?", method="lookahead")


def test_lookahead_serving(store, adapted_lm: LoadedModel) -> None:
    worker = Worker(store, adapted_lm, progress=False)
    pid = worker.prefill(DOC).prefix_id
    n = worker.store.manifest(pid).n_tokens
    lay = adapted_lm.layout
    units = lay.n_layers * lay.n_kv_heads
    runs = {}
    for method, budget in (("full", None), ("lookahead", n), ("lookahead", 24)):
        st = GenerationStats()
        list(worker.generate(pid, " What is the code?", SamplingParams(max_new_tokens=8), method=method,
                             decode=DecodeConfig(budget_tokens=budget), stats=st))
        runs[method, budget] = st
    assert runs["lookahead", n].token_ids == runs["full", None].token_ids  # a covering budget is exact
    small = runs["lookahead", 24]
    assert small.prefix_tokens_per_step == [n * units] + [24 * units] * (small.steps - 1)
    assert small.extra["lookahead_tokens"] == CFG.n_lookahead and small.extra["kept_tokens_per_head"] == 24


def test_lookahead_reads_a_hot_prefix_from_the_host_tier(store, adapted_lm: LoadedModel) -> None:
    """The query step's (and the lookahead pass's) whole-layer reads go through the worker's tiers: a second
    question over the same prefix is served by the host tier, with the tokens of the resident path."""
    lay = adapted_lm.layout
    resident = Worker(store, adapted_lm, progress=False, offload=None)
    pid = resident.prefill(DOC).prefix_id
    layer_pages = lay.n_layers * lay.n_kv_heads * lay.n_pages(store.manifest(pid).n_tokens)
    tiers = OffloadConfig(host_cache_bytes=(layer_pages + 10) * lay.page_bytes, warm_host_fraction=0, io_threads=2)
    offloaded = Worker(store, adapted_lm, progress=False, offload=tiers)

    def ask(w: Worker) -> GenerationStats:
        st = GenerationStats()
        list(w.generate(pid, " What is the code?", SamplingParams(max_new_tokens=8), method="lookahead",
                        decode=DecodeConfig(budget_tokens=24), stats=st))
        return st

    ref, first, again = ask(resident), ask(offloaded), ask(offloaded)
    assert first.token_ids == again.token_ids == ref.token_ids
    assert first.extra["offload_ssd_pages"] == layer_pages
    assert again.extra["offload_ssd_pages"] == 0 and again.extra["offload_host_pages"] == layer_pages
    assert again.bytes_fetched == ref.bytes_fetched and again.prefix_tokens_per_step == ref.prefix_tokens_per_step


def test_lookahead_tokens_ride_the_query_step(store, adapted_lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookahead rows go in with the query's last step (no second forward), and their attention mass over
    the prefix is the separate lookahead pass's."""
    from workers.methods import lookahead as la_mod

    checked: list[int] = []
    original = la_mod.LookaheadAttention._scores

    def compare(self, attn, own, position):  # noqa: ANN001, ANN202 - wraps the method under test
        fused = dict(self.scratch_mass)
        assert len(fused) == adapted_lm.layout.n_layers  # every layer's mass came from the query's step
        separate = la_mod.lookahead_mass(self.lookahead.model, self.lookahead.adapter, own.committed,
                                         attn.layer_full, position)
        for layer, m in separate.items():
            torch.testing.assert_close(fused[layer], m, rtol=1e-4, atol=1e-5)  # fp32 on the CPU
        checked.append(len(fused))
        return original(self, attn, own, position)

    monkeypatch.setattr(la_mod.LookaheadAttention, "_scores", compare)
    separate_passes: list[int] = []
    real_pass = la_mod.lookahead_mass
    monkeypatch.setattr(la_mod, "lookahead_mass", lambda *a, **k: separate_passes.append(1) or real_pass(*a, **k))
    worker = Worker(store, adapted_lm, progress=False)
    pid = worker.prefill(DOC).prefix_id
    st = GenerationStats()
    list(worker.generate(pid, " What is the code?", SamplingParams(max_new_tokens=4), method="lookahead",
                         decode=DecodeConfig(budget_tokens=24), stats=st))
    assert checked == [adapted_lm.layout.n_layers]
    assert len(separate_passes) == 1  # the comparison's own pass only: serving ran none


def test_lookahead_batched_with_others_gives_its_tokens_alone(store, adapted_lm: LoadedModel) -> None:
    """Lookahead rows in a packed step beside other generations (another lookahead one, a plain one) change
    nobody's tokens: each gets what it gets alone."""
    from workers.engine import drain_together

    worker = Worker(store, adapted_lm, progress=False)
    pids = [worker.prefill(DOC).prefix_id, worker.prefill(DOC + " The vault opens at dawn.").prefix_id]
    asks = [(pids[0], " What is the code?", "lookahead"), (pids[1], " When does the vault open?", "full"),
            (pids[1], " What opens at dawn?", "lookahead")]

    def gen(pid: str, q: str, method: str, st: GenerationStats):  # noqa: ANN202 - a generation's iterator
        return worker.generate(pid, q, SamplingParams(max_new_tokens=6), method=method,
                               decode=DecodeConfig(budget_tokens=None if method == "full" else 20), stats=st)

    alone = []
    for a in asks:
        st = GenerationStats()
        list(gen(*a, st))
        alone.append(st.token_ids)
    stats = [GenerationStats() for _ in asks]
    drain_together([gen(*a, st) for a, st in zip(asks, stats, strict=True)])
    assert [s.token_ids for s in stats] == alone
    assert all(s.extra["batch_max"] == len(asks) for s in stats)  # they really shared steps
