"""What several benches share: the model shapes they run and dropping the OS page cache."""

from __future__ import annotations

import os
from pathlib import Path

from lab.tiny_random import TinyLlamaSpec

QUICK_SPEC = TinyLlamaSpec(hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                           max_positions=4096, init_range=0.02)
"""The CPU smoke runs' model (``--quick``)."""


def llama8b_attention_spec(n_layers: int, max_positions: int, *, intermediate_size: int = 4096,
                           never_eos: bool = False) -> TinyLlamaSpec:
    """Random weights with Llama-3.1-8B's attention shape (hidden 4096, 32 q / 8 KV heads, D=128), ``n_layers``
    layers; the MLP is narrower unless ``intermediate_size`` says otherwise (14336 is the real one)."""
    return TinyLlamaSpec(hidden_size=4096, intermediate_size=intermediate_size, n_layers=n_layers, n_heads=32,
                         n_kv_heads=8, max_positions=max_positions, init_range=0.02, never_eos=never_eos)


def drop_os_cache() -> bool:
    """Drop the OS page cache so "cold" reads come from the disk (root only); whether it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True
