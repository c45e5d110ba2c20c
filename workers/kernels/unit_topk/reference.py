"""Torch references of the unit top-k: the group-mean softmax mass, and the k best units per row."""

from __future__ import annotations

import torch


def group_mass_ref(logits: torch.Tensor) -> torch.Tensor:
    """Logits ``[R, G, U]`` -> ``[R, U]`` float32: the mean over ``G`` of each row's softmax over ``U``
    (a row of ``-inf`` contributes 0)."""
    return torch.softmax(logits.float(), dim=-1).nan_to_num(0.0).mean(dim=-2)


def top_units_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores ``[R, U]`` -> ``[R, min(k, U)]`` int64: the ids of the ``k`` highest scores, ties to the lower
    id, in ascending id order."""
    k = max(0, min(k, scores.shape[-1]))
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return best.sort(dim=-1).values


def group_top_units_ref(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits ``[R, G, U]`` -> the ``top_units_ref`` of their ``group_mass_ref``."""
    return top_units_ref(group_mass_ref(logits), k)
