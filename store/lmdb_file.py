"""Checking an LMDB environment before mapping it: a truncated or foreign ``data.mdb`` must never be
mmap'ed (reading past the end of a mapped file is a SIGBUS, which kills the process without a word).

Only the two meta pages are read, with plain file I/O. Layout (LMDB 0.9, 64-bit): a page header of
16 bytes, then ``MDB_meta``: magic, version (u32 each), address, map size (u64 each), two ``MDB_db``
records of 48 bytes (the first one's ``md_pad`` holds the page size), last page number, txn id (u64).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_HEAD = struct.Struct("<II")  # magic, version
_HEAD_AT, _PSIZE_AT, _LAST_AT = 16, 40, 136
_U32, _TAIL = struct.Struct("<I"), struct.Struct("<QQ")  # page size; last page, txn id
_META_BYTES = _LAST_AT + _TAIL.size


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """(page size, last page, txn id) of one meta page, or None when it is none."""
    if len(raw) < _META_BYTES or _HEAD.unpack_from(raw, _HEAD_AT) != (_MAGIC, _VERSION):
        return None
    (psize,) = _U32.unpack_from(raw, _PSIZE_AT)
    last, txn = _TAIL.unpack_from(raw, _LAST_AT)
    return psize, last, txn


def lmdb_damage(path: Path) -> str | None:
    """Why the LMDB environment in directory ``path`` must not be opened, or None when it may be (also when it
    does not exist yet, or its data file is empty: LMDB initializes those)."""
    data = path / DATA_FILE
    try:
        with open(data, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None
            first = _meta(f.read(_META_BYTES))
            if first is None:
                return f"{DATA_FILE} is not an LMDB file (bad first meta page)"
            psize = first[0]
            if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
                return f"{DATA_FILE} names an impossible page size {psize}"
            f.seek(psize)
            second = _meta(f.read(_META_BYTES))
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{DATA_FILE} is unreadable: {e.strerror or e}"
    if second is None or second[0] != psize:
        return f"{DATA_FILE} has no valid second meta page ({size} bytes)"
    _, last, _ = max(first, second, key=lambda m: m[2])  # LMDB uses the meta of the newest transaction
    need = (last + 1) * psize
    if size < need:
        return f"{DATA_FILE} has {size} bytes but its pages reach {need} (truncated)"
    return None


def move_aside(path: Path, why: str) -> Path:
    """Rename a damaged environment to ``<path>.damaged-<time>`` (kept for inspection); returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest = path.with_name(f"{path.name}.damaged-{stamp}-{os.getpid()}")
    os.rename(path, dest)
    log.warning("metadata store %s is damaged (%s): moved it to %s; it is rebuilt from the prefix directories",
                path, why, dest)
    return dest
