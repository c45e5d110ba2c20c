"""The one prompt format shared by the generator, training, evaluation and the runtime."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """How a question is appended to a prefilled document, and how answers look.

    The document is tokenized with the model's special tokens (a leading <s>); the query is
    tokenized on its own with none and appended; the model then answers greedily.
    """

    query_template: str = "\nQuestion: {question}\nAnswer:"
    """Text appended after the document; `{question}` is replaced by the question."""
    answer_prefix: str = " "
    """What every target answer starts with (the model emits it first)."""
    separator: str = ", "
    """Between answers, when a question has several."""
    stop: tuple[str, ...] = ("\n",)
    """Strings that end an answer, besides the tokenizer's end-of-sequence token."""
    repeat_question: str = "Repeat the text above, word for word."
    """The reconstruction task's question (its answer is the document itself)."""

    def query(self, question: str) -> str:
        """The query text for a question."""
        return self.query_template.format(question=question)

    def target(self, answers: Sequence[str]) -> str:
        """The completion the model is trained to produce (before its end-of-sequence token)."""
        return self.answer_prefix + self.separator.join(answers)

    def clean(self, generated: str) -> str:
        """A generated completion cut at the first stop string, stripped."""
        for stop in self.stop:
            generated = generated.split(stop, 1)[0]
        return generated.strip()

    def runtime_config(self, eos_token: str) -> dict[str, object]:
        """The kvstash.json content that tells the runtime how to format and stop queries."""
        return {"query_template": self.query_template, "stop": [eos_token, *self.stop],
                "repeat_question": self.repeat_question, "answer_prefix": self.answer_prefix}


PROMPT = PromptFormat()
