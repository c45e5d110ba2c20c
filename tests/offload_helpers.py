"""Small stored prefixes for the offload tests (fsync off, tiny shapes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from store.config import StoreConfig
from store.kvstore import KVStore
from store.layout import KVLayout
from store.manifest import Manifest
from store.pages import layer_file_name
from store.prefix_key import PrefixKey, tenant_salt, token_hash

LAYERS, HEADS, DIM, PAGE = 3, 2, 16, 16


def layout(dtype: str = "float32") -> KVLayout:
    """3 layers, 2 KV heads, D=16, page 16."""
    return KVLayout(n_layers=LAYERS, n_kv_heads=HEADS, head_dim=DIM, dtype=dtype, page_size=PAGE)


def open_store(home: Path) -> KVStore:
    """An embedded store without fsync (throwaway)."""
    return KVStore(StoreConfig(home=home, fsync=False, page_size=PAGE))


def write_prefix(store: KVStore, n: int, seed: int = 0) -> tuple[Manifest, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A committed prefix of ``n`` random tokens; returns its manifest and K/V per layer."""
    key = PrefixKey(model_fingerprint="offload-test", tenant_salt=tenant_salt("t"),
                    token_hash=token_hash([n, seed]), layout=layout())
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(HEADS, n, DIM, generator=g), torch.randn(HEADS, n, DIM, generator=g)) for _ in range(LAYERS)]
    with store.write_prefix(key, model_name="m", n_tokens=n) as w:
        for i, (k, v) in enumerate(kv):
            w.write_layer(i, k, v)
        m = w.commit()
    return m, kv


def layer_path(store: KVStore, m: Manifest, layer: int) -> Path:
    """Path of a layer's page file."""
    return store.prefix_dir(m.prefix_id) / layer_file_name(layer)


def gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``buf [H, S, D]`` rows ``[H, n]`` -> ``[H, n, D]``."""
    return buf.gather(1, rows.unsqueeze(-1).expand(-1, -1, buf.shape[-1]))


def page_tokens(pages: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[H, n * PAGE]`` of pages ``[H, n]`` and which of them exist (< n_tokens)."""
    tok = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).reshape(pages.shape[0], -1)
    return tok.clamp(max=n_tokens - 1), tok < n_tokens


@contextmanager
def stored_document(lm, home: Path, document: str) -> Iterator[tuple[KVStore, str]]:  # noqa: ANN001 - a LoadedModel
    """A store under ``home`` holding ``document`` prefilled by ``lm`` (resident path): (store, prefix id)."""
    from workers.engine import Worker  # local: the low-level offload tests do not load the worker

    store = KVStore(StoreConfig(home=home, page_size=lm.layout.page_size))
    try:
        yield store, Worker(store, lm, progress=False, offload=None).prefill(document).prefix_id
    finally:
        store.close()
