"""Cache hits, model identity, and clear errors that change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from store.config import StoreConfig
from store.errors import ContextTooLong, CorruptData, InvalidInput, ModelMismatch, PrefixNotFound, UnknownMethod
from store.kvstore import KVStore
from workers.engine import Worker
from workers.model import load_model
from workers.requests import SamplingParams
from workers.textstream import TextStream

DOC = "The treaty was signed in Vienna by Ada Lovelace on a rainy Tuesday. " * 3


def _count_forwards(worker: Worker) -> list[int]:
    calls = [0]
    worker.lm.model.get_decoder().layers[0].register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_second_prefill_is_a_cache_hit_without_forward(store: KVStore, tiny_model_dir: Path) -> None:
    w = Worker(store, load_model(str(tiny_model_dir), progress=False), progress=False)
    calls = _count_forwards(w)
    first = w.prefill(DOC)
    assert not first.cached and calls[0] >= 1
    before = calls[0]
    second = w.prefill(DOC)
    assert second.cached and second.prefix_id == first.prefix_id and calls[0] == before


def test_two_models_never_share_a_prefix(store: KVStore, worker: Worker, other_model_dir: Path) -> None:
    other = Worker(store, load_model(str(other_model_dir), progress=False), progress=False)
    a, b = worker.prefill(DOC), other.prefill(DOC)
    assert a.prefix_id != b.prefix_id and not b.cached
    with pytest.raises(ModelMismatch, match="saved by model"):
        list(other.generate(a.prefix_id, "Who?"))


def test_tenants_do_not_share(worker: Worker) -> None:
    a = worker.prefill(DOC, tenant="alice")
    b = worker.prefill(DOC, tenant="bob")
    assert a.prefix_id != b.prefix_id and not b.cached
    with pytest.raises(PrefixNotFound):
        list(worker.generate(a.prefix_id, "Who?", tenant="bob"))


@pytest.mark.parametrize("doc", ["", "   \n"])
def test_empty_document(worker: Worker, doc: str) -> None:
    with pytest.raises(InvalidInput, match="empty"):
        worker.prefill(doc)
    assert worker.store.list_prefixes() == []


def test_document_longer_than_context(worker: Worker) -> None:
    too_long = "x" * (worker.lm.max_context + 10)
    with pytest.raises(ContextTooLong):
        worker.prefill(too_long)
    assert worker.store.list_prefixes() == []
    assert list(worker.store.prefixes_dir.iterdir()) == []


def test_bad_generate_inputs(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    with pytest.raises(PrefixNotFound):
        list(worker.generate("0" * 32, "Who?"))
    with pytest.raises(InvalidInput):
        list(worker.generate(pid, ""))
    with pytest.raises(UnknownMethod):
        list(worker.generate(pid, "Who?", method="nope"))
    with pytest.raises(InvalidInput):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(InvalidInput):
        SamplingParams(top_p=0)


def test_corrupted_page_is_never_decoded(worker: Worker) -> None:
    pid = worker.prefill(DOC).prefix_id
    path = worker.store.prefix_dir(pid) / "layer_001.kv"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="checksum"):
        list(worker.generate(pid, "Who signed it?"))


def test_prefill_after_failed_prefill_succeeds(store: KVStore, worker: Worker, monkeypatch) -> None:
    import workers.engine as engine

    real = engine.prefill_kv

    def broken(*a, **k):
        gen = real(*a, **k)
        yield next(gen)
        raise RuntimeError("simulated failure mid-prefill")

    monkeypatch.setattr(engine, "prefill_kv", broken)
    with pytest.raises(RuntimeError):
        worker.prefill(DOC)
    assert store.list_prefixes() == [] and list(store.prefixes_dir.iterdir()) == []
    monkeypatch.setattr(engine, "prefill_kv", real)
    assert not worker.prefill(DOC).cached


def test_store_page_size_must_match(tmp_path: Path, lm) -> None:
    s = KVStore(StoreConfig(home=tmp_path, page_size=32))
    with pytest.raises(ValueError, match="page_size"):
        Worker(s, lm)


def test_text_stream_holds_back_stop_prefixes(lm) -> None:
    ts = TextStream(lm.tokenizer, stop=("\nQ:",))
    pieces = [ts.push(t) for t in lm.tokenizer("ab\nQ: more", add_special_tokens=False).input_ids]
    assert "".join(pieces) == "ab" and ts.stopped
    ts2 = TextStream(lm.tokenizer, stop=("\nQ:",))
    pieces = [ts2.push(t) for t in lm.tokenizer("ab\nc", add_special_tokens=False).input_ids]
    assert "".join(pieces) + ts2.finish() == "ab\nc"


def test_prompt_format_from_model_dir(tmp_path: Path) -> None:
    import json

    from workers.prompt import PromptFormat

    assert PromptFormat.load(str(tmp_path)).format_query("hi") == "hi"  # no kvstash.json: the query as-is
    (tmp_path / "kvstash.json").write_text(json.dumps({"query_template": "\nQ: {question}\nA:", "stop": ["\n"]}))
    fmt = PromptFormat.load(str(tmp_path))
    assert fmt.format_query("Who?") == "\nQ: Who?\nA:" and fmt.stop == ("\n",)
    (tmp_path / "kvstash.json").write_text(json.dumps({"query_template": "no placeholder"}))
    with pytest.raises(ValueError, match="question"):
        PromptFormat.load(str(tmp_path))


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46])
def test_a_top_p_under_float32s_range_keeps_the_top_token(top_p: float) -> None:
    # Found by fuzzing the gateway: the nucleus kept nothing and sampling raised (an HTTP 500).
    from workers.sampling import Sampler

    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0), torch.device("cpu"))
    assert [sampler(logits) for _ in range(5)] == [1] * 5


_HOST_MOVES: list[tuple[str, int]] = []


class _Tracked(torch.Tensor):
    """A summary tensor that notes when it is moved (``cpu``/``to``), with the layer it summarizes."""

    _layer: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        if func in (torch.Tensor.cpu, torch.Tensor.to):
            _HOST_MOVES.append(("host", args[0]._layer))
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))  # a plain tensor from here on
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(out, _Tracked) and isinstance(args[0], _Tracked):
            out._layer = args[0]._layer
        return out


def test_prefill_moves_each_layers_summaries_off_the_device_as_they_come(
        store: KVStore, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Summary tensors leave the device right after their layer is summarized, not all at the end (so device
    memory never holds every layer's summaries); the stored artifacts are the same bytes either way."""
    from workers import engine

    real = engine.build_summarizers

    class Noting:
        def __init__(self, inner) -> None:  # noqa: ANN001 - a Summarizer
            self.inner, self.name = inner, inner.name

        def summarize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
            _HOST_MOVES.append(("summarize", layer))
            out = {}
            for name, t in self.inner.summarize(layer, k, v).items():
                out[name] = t.as_subclass(_Tracked)
                out[name]._layer = layer
            return out

    lm = load_model(str(tiny_model_dir), progress=False)
    plain_store = KVStore(StoreConfig(home=tmp_path / "plain", fsync=False))
    plain = Worker(plain_store, lm, progress=False).prefill(DOC)
    plain_store.close()
    monkeypatch.setattr(engine, "build_summarizers", lambda *a, **k: [Noting(s) for s in real(*a, **k)])
    _HOST_MOVES.clear()
    noted = Worker(store, lm, progress=False).prefill(DOC)
    n_layers = lm.layout.n_layers
    assert n_layers >= 2
    for layer in range(n_layers - 1):
        moved = _HOST_MOVES.index(("host", layer))
        assert moved < _HOST_MOVES.index(("summarize", layer + 1)), f"layer {layer}'s summaries stayed on the device"
    assert noted.prefix_id == plain.prefix_id and noted.manifest.artifacts == plain.manifest.artifacts
