"""Turn episodes into token ids and per-position training targets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.synth import Episode

IGNORE = -100
NONE, ANSWER, LM, AGGREGATE = 0, 1, 2, 3
"""Per-position kinds of the next-token target (AGGREGATE: an answer of an aggregation episode)."""


@dataclass(frozen=True)
class Encoded:
    """One sequence: ids[t] predicts targets[t] (IGNORE where untrained); kinds[t] says why."""

    ids: np.ndarray
    targets: np.ndarray
    kinds: np.ndarray


def encode(tok, ep: Episode) -> Encoded:
    """Document with <s>, then each query (no special tokens), its target and </s>.

    Queries and targets are tokenized separately, exactly as the runtime appends them.
    """
    ids = list(tok(ep.document).input_ids)
    kinds = [LM if ep.lm else NONE] * (len(ids) - 1)
    answer = AGGREGATE if ep.aggregation else ANSWER
    for query, target in ep.turns:
        q = tok(query, add_special_tokens=False).input_ids
        a = tok(target, add_special_tokens=False).input_ids + [tok.eos_token_id]
        kinds += [NONE] * len(q) + [answer] * len(a)
        ids += q + a
    kinds.append(NONE)  # the last token predicts nothing
    ids_arr = np.asarray(ids, dtype=np.int64)
    kinds_arr = np.asarray(kinds, dtype=np.uint8)
    targets = np.full_like(ids_arr, IGNORE)
    targets[:-1] = np.where(kinds_arr[:-1] != NONE, ids_arr[1:], IGNORE)
    return Encoded(ids=ids_arr, targets=targets, kinds=kinds_arr)


def collate(items: list[Encoded], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Right-pad (causal attention needs no mask for that) or drop what exceeds `length`."""
    ids = np.full((len(items), length), pad_id, dtype=np.int64)
    targets = np.full((len(items), length), IGNORE, dtype=np.int64)
    kinds = np.zeros((len(items), length), dtype=np.uint8)
    for row, item in enumerate(items):
        if len(item.ids) > length:
            raise ValueError(f"episode of {len(item.ids)} tokens exceeds the batch length {length}")
        n = len(item.ids)
        ids[row, :n], targets[row, :n], kinds[row, :n] = item.ids, item.targets, item.kinds
    return {"input_ids": ids, "targets": targets, "kinds": kinds}
