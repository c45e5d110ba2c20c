"""Serialization of artifacts (dicts of tensors) to the bytes stored as files of a prefix directory."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the functions that need it: the metadata-only paths stay light
    import torch


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize a dict of tensors (safetensors format)."""
    from safetensors.torch import save as st_save

    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of ``tensors_to_bytes``."""
    from safetensors.torch import load as st_load

    return st_load(data)


def digest(data: bytes | memoryview) -> str:
    """blake2b digest used for every checksum in a manifest."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()
