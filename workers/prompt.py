"""How a model wants queries formatted after a document (read from ``kvstash.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROMPT_FILE = "kvstash.json"


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """Query template appended to the document, and default stop strings."""

    query_template: str = "{query}"
    stop: tuple[str, ...] = field(default=())

    def format_query(self, query: str) -> str:
        """The text appended after the document for ``query``."""
        return self.query_template.replace("{query}", query)

    @classmethod
    def load(cls, model_dir: str) -> PromptFormat:
        """Read ``kvstash.json`` of a local model dir; defaults when absent."""
        path = Path(model_dir) / PROMPT_FILE
        if not path.is_file():
            return cls()
        d = json.loads(path.read_text())
        return cls(query_template=d.get("query_template", "{query}"), stop=tuple(d.get("stop", ())))
