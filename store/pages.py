"""Page files: one file per layer, pages ``[kv_head][page]``, K then V, aligned.

Each page also has a keyed CRC32 over (prefix id, layer, head, page, payload), so a read
that returns the bytes of another page or another prefix fails verification.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from store.crc32 import crc32
from store.layout import KVLayout

if TYPE_CHECKING:  # imported where tensors are made: listing and checking a store needs no torch
    import torch

HASH_CHUNK = 1 << 20


def layer_file_name(layer: int) -> str:
    """File name of a layer's pages."""
    return f"layer_{layer:03d}.kv"


def page_crc_seed(prefix_id: str, layer: int, head: int, page: int) -> int:
    """The CRC32 a page's payload CRC starts from: that of its identity."""
    return crc32(f"{prefix_id}:{layer}:{head}:{page}".encode())


def page_crc(prefix_id: str, layer: int, head: int, page: int, payload: memoryview | bytes) -> int:
    """CRC32 of a page's payload keyed by its identity."""
    return crc32(payload, page_crc_seed(prefix_id, layer, head, page)) & 0xFFFFFFFF


def pack_layer(layout: KVLayout, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Lay out one layer's K/V ``[kv_heads, n_tokens, head_dim]`` as page-file bytes (on K's device)."""
    import torch

    h, n, d = k.shape
    p = layout.page_size
    n_pages = layout.n_pages(n)
    pages = torch.zeros(h, n_pages, layout.page_bytes, dtype=torch.uint8, device=k.device)
    kv = torch.zeros(h, n_pages * p, 2, d, dtype=layout.torch_dtype, device=k.device)
    kv[:, :n, 0] = k.to(layout.torch_dtype)
    kv[:, :n, 1] = v.to(layout.torch_dtype)
    # [h, pages, p, 2, d] -> [h, pages, 2, p, d]: K block then V block inside a page.
    kv = kv.view(h, n_pages, p, 2, d).transpose(2, 3).contiguous()
    payload = kv.view(h, n_pages, -1).view(torch.uint8)
    pages[:, :, : layout.page_payload_bytes] = payload
    return pages


def unpack_pages(layout: KVLayout, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split raw page bytes ``[..., page_bytes]`` into K and V ``[..., page_size, head_dim]``."""
    payload = raw[..., : layout.page_payload_bytes].contiguous()
    kv = payload.view(layout.torch_dtype).unflatten(-1, (2, layout.page_size, layout.head_dim))
    return kv[..., 0, :, :], kv[..., 1, :, :]


def write_bytes_durably(path: Path, data: np.ndarray, fsync: bool = True) -> None:
    """Write bytes to ``path`` (fsync'd unless told not to)."""
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(data).data.cast("B"))
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def file_digest(path: Path) -> str:
    """blake2b digest of a file's contents (page files of manifests written before version 2 carry one)."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
