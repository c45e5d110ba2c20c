"""The shipped tokenizer: loads offline, BOS handling, digits split, round trip; training works."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lab.train.tokenizer import BOS, EOS, PAD, build_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvstash-tiny"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 8192


def test_bos_only_with_special_tokens(tok):
    with_bos = tok("Some text 42.").input_ids
    without = tok("Some text 42.", add_special_tokens=False).input_ids
    assert with_bos[0] == tok.bos_token_id and with_bos[1:] == without
    assert tok.bos_token_id not in without and tok.eos_token_id not in with_bos


def test_digits_are_single_tokens(tok):
    ids = tok(" 9081726", add_special_tokens=False).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-7:] == list("9081726")


def test_round_trip(tok):
    text = 'He said, "VAR QWERT = 12345 ."\nQuestion: what?\nAnswer: 3f2a-b1'
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text


def test_build_tokenizer_small():
    texts = iter(["the cat sat on the mat 123"] * 50)
    small = build_tokenizer(texts, vocab_size=300)
    assert small("the cat").input_ids[0] == small.bos_token_id
    assert len(small) <= 300
