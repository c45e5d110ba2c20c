"""Checking every byte of a prefix's page files: by their keyed page CRCs, or by a blake2b of each whole file
where the manifest recorded one (``FileInfo.check``: manifests written before version 2).

A page file checked by its CRCs is read in chunks of ``CHECK_CHUNK_BYTES``, the next chunk read (``os.preadv``,
GIL released) while this one is checked against the ``page_crc`` artifact, whose own blake2b is checked first, by
``store.page_io.verify_pages`` (one page CRC kernel call per chunk where it is built, GIL released; else one C CRC
call per MiB). A page that fails is named. Used by
``KVStore.verify``, ``KVStore.check`` and the recovery of directories committed before their files were synced.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from store import disk_record
from store.errors import CorruptData
from store.manifest import FILE_DIGEST, PAGE_CRC_ARTIFACT, Manifest
from store.page_io import PosixPageReader, plan_runs, verify_pages
from store.pages import file_digest

CHECK_CHUNK_BYTES = 16 << 20
"""Bytes of a page file read and checked at a time (two such buffers: one being read, one checked)."""


def page_files_problem(directory: Path, m: Manifest) -> str | None:
    """What is wrong with the bytes of ``m``'s page files in ``directory`` (each read whole), or None."""
    table: np.ndarray | None = None
    for layer, f in enumerate(m.files):
        if f.check == FILE_DIGEST:
            if file_digest(directory / f.name) != f.blake2b:
                return f"page file {f.name} failed its checksum"
            continue
        if table is None:
            table, bad = page_crc_table(directory, m)
            if table is None:
                return bad
        if (bad := crc_problem(directory / f.name, m, layer, table[layer])) is not None:
            return bad
    return None


def page_crc_table(directory: Path, m: Manifest) -> tuple[np.ndarray | None, str | None]:
    """The prefix's page CRCs ``uint32 [layers, kv_heads, pages]`` read from its directory and checked against the
    manifest's digest; else (None, what is wrong)."""
    try:
        read = disk_record.start_artifact_read(directory, m, PAGE_CRC_ARTIFACT)
        if read is None:
            return None, f"no {PAGE_CRC_ARTIFACT!r} artifact: its page files cannot be checked"
        data = read.data()
    except disk_record.InvalidRecord as e:
        return None, str(e)
    lay = m.layout
    shape = (lay.n_layers, lay.n_kv_heads, lay.n_pages(m.n_tokens))
    if len(data) != 4 * shape[0] * shape[1] * shape[2]:
        return None, f"artifact {PAGE_CRC_ARTIFACT!r} has {len(data)} bytes, not {4 * int(np.prod(shape))}"
    return np.frombuffer(data, dtype=np.uint32).reshape(shape), None


def crc_problem(path: Path, m: Manifest, layer: int, crcs: np.ndarray) -> str | None:
    """What is wrong with the page file ``path`` of ``layer`` (its size, a read, a page failing its keyed CRC of
    ``crcs`` ``[kv_heads, pages]``), or None."""
    lay = m.layout
    n_pages, page_bytes = lay.n_pages(m.n_tokens), lay.page_bytes
    total = lay.n_kv_heads * n_pages
    per = max(1, CHECK_CHUNK_BYTES // page_bytes)
    starts = list(range(0, total, per))
    bufs = [np.empty((min(per, total), page_bytes), dtype=np.uint8) for _ in range(min(2, len(starts)))]
    reader = PosixPageReader()

    def read(i: int) -> np.ndarray:
        linear = np.arange(starts[i], min(total, starts[i] + per), dtype=np.int64)
        reader.read(path, lay.layer_file_bytes(m.n_tokens), plan_runs(linear), page_bytes, bufs[i % 2])
        return linear

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="kvstash-check") as io:  # exits once no read is in flight
            ahead = io.submit(read, 0) if starts else None
            for i in range(len(starts)):
                assert ahead is not None
                linear = ahead.result()
                ahead = io.submit(read, i + 1) if i + 1 < len(starts) else None
                verify_pages(m.prefix_id, layer, n_pages, linear, bufs[i % 2], crcs)
    except CorruptData as e:
        return str(e)
    finally:
        reader.close()
    return None

