"""Incremental detokenization with stop strings: token ids in, safe text pieces out."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns a growing list of token ids into text pieces, holding back partial characters
    and anything that could still become a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is safe to show (may be empty)."""
        self.ids.append(token_id)
        text = self._decode()
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        if text.endswith(REPLACEMENT):
            return ""  # an incomplete multi-byte character
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(text[: len(text) - hold])

    def finish(self) -> str:
        """Text held back at the end of generation (not a stop string)."""
        if self.stopped:
            return ""
        return self._emit(self._decode())

    def _decode(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, upto: str) -> str:
        piece = upto[self.emitted:]
        self.emitted = max(self.emitted, len(upto))
        return piece
