"""Greedy generation from a stored prefix equals plain transformers generate on document + query."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.engine import Worker
from workers.model import LoadedModel
from workers.requests import GenerationStats, SamplingParams

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november"]


def _document(n_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(WORDS), (n_words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in idx) + f" The code is {seed * 7919 % 10000}."


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _reference_ids(reference_model, lm: LoadedModel, doc: str, query: str, n_new: int) -> list[int]:
    ids = lm.tokenizer(doc).input_ids + lm.tokenizer(query, add_special_tokens=False).input_ids
    out = reference_model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                   eos_token_id=None, pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


# Document lengths straddle page (16) and prefill-chunk (40) boundaries.
@pytest.mark.parametrize(("n_words", "seed", "query"), [
    (3, 0, "?"),
    (20, 1, " What is the code?"),
    (47, 2, " code"),
    (90, 3, " Tell me the code, please. The code is"),
])
def test_greedy_matches_transformers_generate(worker: Worker, lm: LoadedModel, reference_model,
                                              n_words: int, seed: int, query: str) -> None:
    doc = _document(n_words, seed)
    n_new = 24
    pre = worker.prefill(doc)
    stats = GenerationStats()
    # No stop tokens: compare the full n_new-token continuation.
    text = "".join(worker.generate(pre.prefix_id, query, SamplingParams(max_new_tokens=n_new), stats=stats))
    ref = _reference_ids(reference_model, lm, doc, query, n_new)
    eos = lm.eos_ids
    ref_until_eos = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert stats.token_ids == ref_until_eos
    assert text == lm.tokenizer.decode(ref_until_eos, skip_special_tokens=True)
    assert stats.steps >= 1 and stats.bytes_fetched > 0


def test_lengths_cover_page_boundaries(lm: LoadedModel) -> None:
    """The parametrization above must include lengths that are not a multiple of the page size."""
    lengths = [len(lm.tokenizer(_document(n, s)).input_ids) for n, s in [(3, 0), (20, 1), (47, 2), (90, 3)]]
    assert any(n % lm.layout.page_size for n in lengths)
    assert max(lengths) > 40  # more than one prefill chunk


def test_sampling_is_seeded(worker: Worker) -> None:
    pre = worker.prefill(_document(30, 5))
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=123)
    runs = []
    for _ in range(2):
        st = GenerationStats()
        list(worker.generate(pre.prefix_id, " Go:", params, stats=st))
        runs.append(st.token_ids)
    assert runs[0] == runs[1]
    st = GenerationStats()
    list(worker.generate(pre.prefix_id, " Go:", SamplingParams(max_new_tokens=16, temperature=1.0, seed=7), stats=st))
    assert st.token_ids != runs[0]
