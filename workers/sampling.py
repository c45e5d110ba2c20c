"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seed."""

from __future__ import annotations

import torch

from workers.requests import SamplingParams


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
        return int(self.pick(logits))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id from logits ``[vocab]``, as a 0-dim long tensor on their device (nothing waits for the
        device: a step launched ahead feeds it on)."""
        p = self.params
        if p.temperature == 0:
            return torch.argmax(logits)
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            keep[0] = True  # the top token always stays, also when top_p is under float32's smallest value
            # the dropped tokens' probabilities become exactly 0 (a mask, not an index: no host sync)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
        # An exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, without the host
        # sync of torch.multinomial's input check. Tokens outside the nucleus (p_i = 0) can never win, also not
        # where E_i comes out 0.
        race = torch.empty_like(probs).exponential_(1.0, generator=self.gen)
        return torch.argmax(torch.where(probs > 0, probs / race, -1.0))


def pick_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token id by ``samplers[i]`` from logits ``[B, vocab]``, as a ``[B]`` long tensor on their device
    (nothing waits for it): the greedy rows in one argmax (each row's first maximum, as one row's argmax picks),
    each sampling row by its own generator, advanced once."""
    picks = logits.argmax(-1)
    for i, s in enumerate(samplers):
        if s.params.temperature != 0:
            picks[i] = s.pick(logits[i])
    return picks


def sample_rows(samplers: list[Sampler], rows: list[torch.Tensor]) -> list[int]:
    """One token id per (sampler, logits row ``[vocab]``), with one sync."""
    return pick_rows(samplers, torch.stack(rows)).tolist() if rows else []
