"""Serialization of artifacts (dicts of tensors) to the bytes stored as files of a prefix directory.

An artifact may also be produced as chunks (``ArtifactData``): ``tensors_to_chunks`` gives the bytes of
``tensors_to_bytes`` one tensor at a time (``store.layer_artifact`` writes a prefill's summaries layer by layer).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from store.errors import InvalidInput

if TYPE_CHECKING:  # torch is imported by the functions that need it: the metadata-only paths stay light
    import torch

ArtifactData = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]
"""An artifact's bytes, whole or as the chunks they arrive in (written as they are pulled)."""
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
                "F64", "I64", "U64")
"""safetensors' dtypes in the order it lays tensors out (widest first, then by name), so our bytes equal its own."""


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors' dtype names and torch's dtypes (built on first use: torch is imported only then)."""
    import torch

    return {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
            "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
            "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
            "C64": torch.complex64, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize a dict of tensors (safetensors format)."""
    from safetensors.torch import save as st_save

    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header parsed (safetensors' own limit)."""


def bytes_to_tensors(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Inverse of ``tensors_to_bytes``. A writable buffer (``bytearray``, as the store reads artifacts) is not
    copied: the tensors are views of it; ``bytes`` go through safetensors, which copies them."""
    if isinstance(data, bytes):
        from safetensors.torch import load as st_load

        return st_load(data)
    return _tensors_in(memoryview(data).cast("B"))


def _tensors_in(view: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors buffer as views of it; InvalidInput when the layout is not one it can hold."""
    if view.readonly:
        raise InvalidInput("a read-only buffer cannot be viewed as tensors")
    return {name: span.tensor(view) for name, span in safetensors_layout(view).items()}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor of a safetensors buffer lies: ``[start, end)`` of the whole buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def tensor(self, view: memoryview) -> torch.Tensor:
        """The tensor as a view of ``view`` (a writable buffer of the whole artifact)."""
        import torch

        numel = math.prod(self.shape)
        return (torch.frombuffer(view, dtype=self.dtype, count=numel, offset=self.start).reshape(self.shape)
                if numel else torch.empty(self.shape, dtype=self.dtype))


def header_end(view: memoryview) -> int:
    """The end of a safetensors buffer's header (the 8-byte length field must be in ``view``); InvalidInput when
    the header cannot fit the buffer (``view`` is the whole of it)."""
    if len(view) < 8:
        raise InvalidInput("not a safetensors buffer: shorter than its header length")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > min(MAX_HEADER_BYTES, len(view) - 8):
        raise InvalidInput(f"safetensors header of {hlen} bytes does not fit a buffer of {len(view)}")
    return 8 + hlen


def safetensors_layout(view: memoryview) -> dict[str, TensorSpan]:
    """Each tensor's span in a safetensors buffer (``view`` is the whole of it; only its header is read, so the
    data may still be arriving); InvalidInput when the layout is not one it can hold."""
    base = header_end(view)
    try:
        header = json.loads(bytes(view[8:base]))
    except ValueError as e:
        raise InvalidInput(f"safetensors header does not parse: {e}") from None
    if not isinstance(header, dict):
        raise InvalidInput("safetensors header is not an object")
    body = len(view) - base
    out: dict[str, TensorSpan] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = (_torch_dtypes()[entry["dtype"]], [int(d) for d in entry["shape"]],
                                      entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"tensor {name!r}: bad safetensors entry") from None
        if (min(shape, default=0) < 0 or not isinstance(lo, int) or not isinstance(hi, int)
                or not 0 <= lo <= hi <= body or hi - lo != math.prod(shape) * dtype.itemsize):
            raise InvalidInput(f"tensor {name!r}: shape {shape} and offsets [{lo}, {hi}) do not fit the buffer")
        out[name] = TensorSpan(dtype=dtype, shape=tuple(shape), start=base + lo, end=base + hi)
    return out


def new_digest() -> hashlib.blake2b:
    """An empty hash of the kind ``digest`` gives (fed incrementally by streamed writes)."""
    return hashlib.blake2b(digest_size=32)


def digest(data: bytes | memoryview) -> str:
    """blake2b digest used for every checksum in a manifest."""
    h = new_digest()
    h.update(data)
    return h.hexdigest()


def as_chunks(data: ArtifactData) -> Iterable[bytes | bytearray | memoryview]:
    """``data`` as chunks: whole bytes are one chunk."""
    return (data,) if isinstance(data, bytes | bytearray | memoryview) else data


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: its dtype name, shape and size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _entry(t: torch.Tensor) -> _Entry:
    names = {dtype: name for name, dtype in _torch_dtypes().items()}
    if t.dtype not in names:
        raise InvalidInput(f"tensors of dtype {t.dtype} cannot be stored in an artifact")
    return _Entry(dtype=names[t.dtype], shape=tuple(t.shape), nbytes=t.numel() * t.element_size())


def _header(entries: Mapping[str, _Entry], order: list[str] | None = None) -> tuple[bytes, list[str]]:
    """The safetensors header (length, JSON, space padding to 8 bytes) of ``entries`` with their data in ``order``
    (default: safetensors' own, so the file is byte for byte what ``tensors_to_bytes`` gives), and that order."""
    if order is None:
        order = sorted(entries, key=lambda n: (-_DTYPE_ORDER.index(entries[n].dtype), n))
    fields, offset = {}, 0
    for name in order:
        e = entries[name]
        fields[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes on the host (a copy only when it is on a device or not contiguous)."""
    import torch

    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data


def tensors_to_chunks(tensors: Mapping[str, torch.Tensor]) -> Iterator[memoryview | bytes]:
    """The bytes of ``tensors_to_bytes(tensors)`` as chunks, its header first, then one tensor's at a time (copied
    to the host only when pulled)."""
    header, order = _header({name: _entry(t) for name, t in tensors.items()})
    yield header
    for name in order:
        yield _raw(tensors[name])
