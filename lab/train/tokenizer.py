"""Train the byte-level BPE tokenizer (digits split one by one; <pad>, <s>, </s>)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lab.synth import corpus
from lab.synth.values import number_value, uuid_value, variable_name

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2
VOCAB_SIZE = 8192
SYNTHETIC_LINES = 20000
SEED = "tokenizer"


def synthetic_lines(n: int) -> Iterator[str]:
    """Lines shaped like the synthetic tasks, so their building blocks get tokens."""
    rng = random.Random(SEED)
    vocab = corpus.words("train")
    for _ in range(n):
        key = f"{rng.choice(vocab)}-{rng.choice(vocab)}"
        yield f"One of the special magic numbers for {key} is: {number_value(rng)}."
        yield f"One of the special magic uuids for {key} is: {uuid_value(rng)}."
        yield f"VAR {variable_name(rng)} = VAR {variable_name(rng)} ."
        yield "\nQuestion: What is the special magic number for " + key + " mentioned in the provided text?\nAnswer:"


def build_tokenizer(texts: Iterator[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; encoding with special tokens prepends <s>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20
    )


def training_texts() -> Iterator[str]:
    """The training split's paragraphs followed by synthetic task lines (no held-out text)."""
    yield from corpus.paragraphs("train")
    yield from synthetic_lines(SYNTHETIC_LINES)


def main() -> None:
    """CLI: python -m lab.train.tokenizer --out models/<name>."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    build_tokenizer(training_texts(), args.vocab_size).save_pretrained(args.out)


if __name__ == "__main__":
    main()
