"""The byte layout of a prefix's KV pages, shared by the store and the workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Page files are read with direct I/O on GDS machines, which needs 4 KiB alignment.
PAGE_ALIGN = 4096

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each storable dtype (named as in torch); torch itself is imported only for tensors."""


def torch_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a storable dtype name."""
    import torch

    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The storable name of a torch dtype (inverse of ``torch_dtype_of``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype}")
    return name


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape of one prefix's KV: every size in bytes is derived here and nowhere else.

    A page holds ``page_size`` consecutive tokens of one layer and one KV head: the K block
    ``[page_size, head_dim]`` followed by the V block, padded to ``PAGE_ALIGN`` bytes.
    A layer's file stores pages ordered ``[kv_head][page]``.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for name in ("n_layers", "n_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of stored K and V."""
        return torch_dtype_of(self.dtype)

    @property
    def elem_bytes(self) -> int:
        """Bytes per stored element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one page's K (or V) block."""
        return self.page_size * self.head_dim * self.elem_bytes

    @property
    def page_payload_bytes(self) -> int:
        """Bytes of K and V of one page, before alignment padding."""
        return 2 * self.block_bytes

    @property
    def page_bytes(self) -> int:
        """Stride of one page in a layer file (payload rounded up to PAGE_ALIGN)."""
        return -(-self.page_payload_bytes // PAGE_ALIGN) * PAGE_ALIGN

    def n_pages(self, n_tokens: int) -> int:
        """Pages per (layer, KV head) for a prefix of ``n_tokens``."""
        return -(-n_tokens // self.page_size)

    def layer_file_bytes(self, n_tokens: int) -> int:
        """Size of one layer's page file."""
        return self.n_kv_heads * self.n_pages(n_tokens) * self.page_bytes

    def page_offset(self, head: int, page: int, n_tokens: int) -> int:
        """Byte offset of (head, page) inside its layer file."""
        return (head * self.n_pages(n_tokens) + page) * self.page_bytes

    def token_kv_bytes(self) -> int:
        """Bytes of K and V of one token of one layer and KV head (unpadded)."""
        return 2 * self.head_dim * self.elem_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (round-trips through ``from_dict``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """Inverse of ``to_dict``; unknown keys are an error."""
        return cls(**d)
