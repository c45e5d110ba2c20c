"""Synthetic task suite: determinism, length fitting, answers, scorer, held-out splits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lab.synth import NIAH_TASKS, PROMPT, TASKS, SynthContext, corpus, generate, ruler_score
from lab.synth.dense import DenseRecall, PlainText

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def ctx(tok):
    return SynthContext(tok, "eval")


def prompt_len(tok, sample) -> int:
    doc = tok(sample.document).input_ids
    return len(doc) + len(tok(sample.query, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("n_tokens", [333, 1500])
def test_prompt_fits_target_length(tok, ctx, task, n_tokens):
    sample = generate(task, n_tokens, 7, ctx)
    slack = max(0.1 * n_tokens, 64)  # one haystack unit (a UUID needle) is up to ~60 tokens
    assert n_tokens - slack <= prompt_len(tok, sample) <= n_tokens


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_and_seed_dependent(ctx, task):
    a, b, c = (generate(task, 600, s, ctx) for s in (3, 3, 4))
    assert a == b
    assert a.document != c.document


@pytest.mark.parametrize("task", sorted(TASKS))
def test_target_scores_one_and_answers_in_document(ctx, task):
    sample = generate(task, 800, 1, ctx)
    assert sample.score(sample.target) == 1.0
    assert sample.score("") == 0.0
    assert all(a in sample.document for a in sample.answers)
    assert sample.target.startswith(PROMPT.answer_prefix) and "\n" not in sample.target


def test_ruler_score_is_fraction_found():
    assert ruler_score("The answer: 12, 34", ("12", "56", "34", "78")) == 0.5
    assert ruler_score("ABC", ("abc",)) == 1.0


def test_query_is_separate_and_formatted(ctx):
    sample = generate("niah_single", 500, 0, ctx)
    assert sample.query == PROMPT.query_template.format(question=sample.query.split("Question: ")[1].split("\n")[0])
    assert sample.query not in sample.document
    assert PROMPT.clean(" 1234567\nQuestion: more") == "1234567"
    assert PROMPT.runtime_config("</s>") == {"query_template": PROMPT.query_template, "stop": ["</s>", "\n"],
                                             "repeat_question": PROMPT.repeat_question,
                                             "answer_prefix": PROMPT.answer_prefix}


def test_multikey_has_distractors_and_multivalue_has_all_values(ctx):
    mk = generate("niah_multikey", 1000, 2, ctx)
    assert mk.document.count("special magic numbers for") == 4
    mv = generate("niah_multivalue", 1000, 2, ctx)
    key = mv.query.split(" for ")[1].split(" mentioned")[0]
    assert mv.document.count(f"numbers for {key} is:") == 4 and len(mv.answers) == 4


def test_variable_tracking_chain_in_document_order(ctx):
    vt = generate("vt", 1000, 5, ctx)
    positions = [vt.document.index(f"VAR {name} =") for name in vt.answers]
    assert positions == sorted(positions)
    value = vt.query.split("value ")[1].split(" ")[0]
    assert f"VAR {vt.answers[0]} = {value} ." in vt.document


def test_splits_are_disjoint():
    assert not set(corpus.words("train")) & set(corpus.words("eval"))
    train_text = set(corpus.paragraphs("train"))
    assert not any(p in train_text for p in corpus.paragraphs("eval")[:500])


def test_eval_samples_use_heldout_words(tok):
    train_words, eval_words = set(corpus.words("train")), set(corpus.words("eval"))
    for split, own, other in (("eval", eval_words, train_words), ("train", train_words, eval_words)):
        sample = generate("niah_single_word", 600, 0, SynthContext(tok, split))
        key = sample.query.split(" for ")[1].split(" mentioned")[0]
        assert set(key.split("-")) <= own and sample.answers[0] in own
        assert sample.answers[0] not in other


def test_training_episodes_fit(tok):
    ctx = SynthContext(tok, "train")
    for seed in range(4):
        ep = DenseRecall().episode(ctx, 2048, seed)
        n = len(tok(ep.document).input_ids) + sum(
            len(tok(q + t, add_special_tokens=False).input_ids) + 1 for q, t in ep.turns
        )
        assert len(ep.turns) >= 1 and 0.8 * 2048 <= n <= 2048 + 2 * len(ep.turns)
    lm = PlainText().episode(ctx, 512, 0)
    assert lm.lm and not lm.turns and len(tok(lm.document).input_ids) <= 512


def test_niah_task_list():
    assert set(NIAH_TASKS) <= set(TASKS) and "niah_single" in NIAH_TASKS and "vt" not in NIAH_TASKS


@pytest.mark.parametrize("n_tokens", [300, 2048, 6000])
def test_compare_answer_is_the_more_frequent_of_the_two_asked(ctx, n_tokens):
    for seed in range(4):
        s = generate("compare", n_tokens, seed, ctx)
        question = s.query.split("Question: ")[1].split("\n")[0]
        pair = question.split("list above, ")[1].rstrip("?").split(" or ")
        counts = Counter(s.document.split(", "))
        more, less = sorted(pair, key=lambda w: -counts[w])
        assert s.answers == (more,) and counts[more] > counts[less] > 0
        assert more not in less and less not in more  # a string-match score cannot credit the other word
        ratio = counts[more] / counts[less]
        assert 1.0 < ratio <= 3.0, ratio
        # Distractors recur as often, so the pair is not simply the list's most frequent words.
        frequent = [w for w, n in counts.items() if n >= counts[less]]
        assert len(frequent) >= 3
        if n_tokens >= 2048:  # far more occurrences than a 1 % top-k keeps per head
            assert counts[more] + counts[less] > 0.01 * n_tokens * 2


def test_compare_draws_differ_in_which_word_wins_first(ctx):
    firsts = []
    for seed in range(12):
        s = generate("compare", 600, seed, ctx)
        first = s.query.split("list above, ")[1].split(" or ")[0]
        firsts.append(first == s.answers[0])
    assert 0 < sum(firsts) < len(firsts)  # the answer's position in the question carries no signal
