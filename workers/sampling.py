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
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            keep[0] = True  # the top token always stays, also when top_p is under float32's smallest value
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))
