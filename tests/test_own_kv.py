"""A generation's own-token K/V buffer grows as it is written and keeps every written position."""

from __future__ import annotations

import pytest
import torch

from store.layout import KVLayout
from workers.own_kv import OwnKV

LAYOUT = KVLayout(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32", page_size=16)


def test_grows_by_doubling_within_capacity_and_keeps_written_tokens() -> None:
    own = OwnKV(LAYOUT, capacity=20, device=torch.device("cpu"), dtype=torch.float32, initial=3)
    start = own.nbytes
    written = []
    for step in range(20):
        kv = torch.full((2, 1, 4), float(step))
        for layer in range(2):
            k, v = own.write(layer, kv, -kv)
        own.commit(1)
        written.append(float(step))
        assert k[0, :, 0].tolist() == written and v[1, :, 0].tolist() == [-x for x in written]
    assert own.nbytes == 20 * start // 3  # 3 -> 6 -> 12 -> 20 (capped), never more
    with pytest.raises(ValueError, match="capacity"):
        own.write(0, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))


def test_growing_keeps_every_layers_committed_tokens() -> None:
    own = OwnKV(LAYOUT, capacity=10, device=torch.device("cpu"), dtype=torch.float32, initial=2)
    own.write(0, torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    own.write(1, torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    own.commit(2)
    k0, _ = own.write(0, torch.full((2, 3, 4), 2.0), torch.full((2, 3, 4), 2.0))  # grows at layer 0
    k1, _ = own.write(1, torch.full((2, 3, 4), 3.0), torch.full((2, 3, 4), 3.0))
    assert k0[0, :, 0].tolist() == [1, 1, 2, 2, 2] and k1[0, :, 0].tolist() == [1, 1, 3, 3, 3]
