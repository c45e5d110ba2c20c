"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from store.errors import InvalidInput


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidInput("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise InvalidInput("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidInput("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise InvalidInput("stop strings must be non-empty")


class Sampler:
    """Picks next tokens from logits according to ``SamplingParams``."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.gen = torch.Generator(device=device)
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from logits ``[vocab]``."""
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))
