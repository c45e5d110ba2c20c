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
        if self.params.temperature == 0:
            return torch.argmax(logits)
        return sample_like([self], logits.unsqueeze(0))[0]

    @property
    def group(self) -> tuple[float, float]:
        """What rows must share to be sampled in one batch: (temperature, top_p)."""
        return self.params.temperature, self.params.top_p


def sample_like(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token id from logits ``[B, vocab]`` by temperature + nucleus sampling, every sampler with the
    same (non-zero) temperature and top_p, each drawing from its own generator (advanced once): ``[B]`` long on
    the logits' device, with no host sync. One softmax, sort and scan for the whole batch instead of one each."""
    temperature, top_p = samplers[0].group
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < top_p
        keep[:, 0] = True  # the top token always stays, also when top_p is under float32's smallest value
        # the dropped tokens' probabilities become exactly 0 (a mask, not an index: no host sync)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    # An exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, without the host
    # sync of torch.multinomial's input check. Tokens outside the nucleus (p_i = 0) can never win, also not
    # where E_i comes out 0. Each row's E from its own generator: a generation's draws do not depend on its batch.
    race = torch.empty_like(probs)
    for row, s in zip(race, samplers, strict=True):
        row.exponential_(1.0, generator=s.gen)
    return torch.argmax(torch.where(probs > 0, probs / race, -1.0), dim=-1)


def pick_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token id by ``samplers[i]`` from logits ``[B, vocab]``, as a ``[B]`` long tensor on their device
    (nothing waits for it): the greedy rows in one argmax (each row's first maximum, as one row's argmax picks),
    the sampling rows of each (temperature, top_p) in one batch (``sample_like``), each generator advanced once."""
    picks = logits.argmax(-1)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, s in enumerate(samplers):
        if s.params.temperature != 0:
            groups.setdefault(s.group, []).append(i)
    for rows in groups.values():
        lo, hi = rows[0], rows[-1] + 1
        consecutive = hi - lo == len(rows)
        # Consecutive rows are a view; others are gathered by stacking views (an index tensor would be a copy
        # from the host).
        block = logits[lo:hi] if consecutive else torch.stack([logits[i] for i in rows])
        got = sample_like([samplers[i] for i in rows], block)
        if consecutive:
            picks[lo:hi] = got
        else:
            for j, i in enumerate(rows):
                picks[i] = got[j]
    return picks


def sample_rows(samplers: list[Sampler], rows: list[torch.Tensor]) -> list[int]:
    """One token id per (sampler, logits row ``[vocab]``), with one sync."""
    return pick_rows(samplers, torch.stack(rows)).tolist() if rows else []
