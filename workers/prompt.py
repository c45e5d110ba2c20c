"""How a model wants queries formatted after a document (read from ``kvstash.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROMPT_FILE = "kvstash.json"
PLACEHOLDER = "{question}"
"""Where the user's query goes in ``query_template`` (the training format's name for it)."""
DEFAULT_REPEAT_QUESTION = "Repeat the previous context exactly."
"""KVzip's reconstruction request, for models whose ``kvstash.json`` names none."""


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """Query template appended to the document, and default stop strings."""

    query_template: str = PLACEHOLDER
    stop: tuple[str, ...] = field(default=())
    repeat_question: str = DEFAULT_REPEAT_QUESTION
    """The question that asks the model to repeat the document (KVzip's reconstruction scoring)."""
    answer_prefix: str = ""
    """What an answer starts with after the query template (the repeated document follows it)."""

    def format_query(self, query: str) -> str:
        """The text appended after the document for ``query``."""
        return self.query_template.replace(PLACEHOLDER, query)

    @classmethod
    def load(cls, model_dir: str) -> PromptFormat:
        """Read ``kvstash.json`` of a local model dir; defaults when absent."""
        path = Path(model_dir) / PROMPT_FILE
        if not path.is_file():
            return cls()
        d = json.loads(path.read_text())
        template = d.get("query_template", PLACEHOLDER)
        if PLACEHOLDER not in template:
            raise ValueError(f"{path}: query_template must contain {PLACEHOLDER}")
        return cls(query_template=template, stop=tuple(d.get("stop", ())),
                   repeat_question=str(d.get("repeat_question", DEFAULT_REPEAT_QUESTION)),
                   answer_prefix=str(d.get("answer_prefix", "")))
