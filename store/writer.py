"""Writing one prefix: page files into a private temp dir, then an atomic rename and the manifest."""

from __future__ import annotations

import functools
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from store.artifacts import digest
from store.errors import InvalidInput
from store.layout import KVLayout
from store.manifest import ArtifactInfo, FileInfo, Manifest
from store.pages import bytes_digest, layer_file_name, pack_layer, page_crc, write_bytes_durably
from store.prefix_key import PrefixKey

if TYPE_CHECKING:
    from store.kvstore import KVStore

PAGE_CRC_ARTIFACT = "page_crc"
"""The artifact holding every page's keyed CRC ``uint32 [layers, kv_heads, pages]``."""
MAX_PENDING_LAYERS = 2
"""Layers a prefix writer may hold in flight (memory bound: each is one layer's page-file bytes)."""
TMP_PREFIX = ".tmp-"
"""Name prefix of writers' temp dirs (``.tmp-<prefix id>-<pid>-<random>``)."""


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PrefixWriter:
    """Writes one prefix into a private temp dir; ``commit`` makes it visible atomically."""

    def __init__(self, store: KVStore, key: PrefixKey, *, model_name: str, n_tokens: int, tenant: str):
        self.store, self.key, self.model_name, self.n_tokens, self.tenant = store, key, model_name, n_tokens, tenant
        self.prefix_id = key.prefix_id
        self.layout: KVLayout = key.layout
        self.tmp_dir = store.prefixes_dir / f"{TMP_PREFIX}{self.prefix_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp_dir.mkdir(parents=True)
        self._files: dict[int, FileInfo] = {}
        self._artifacts: dict[str, bytes] = {}
        n_pages = self.layout.n_pages(n_tokens)
        self._crc = np.zeros((self.layout.n_layers, self.layout.n_kv_heads, n_pages), dtype=np.uint32)
        threads = store.config.write_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstash-write") if threads > 0 else None
        self._pending: list[tuple[int, str, int, Future, list[Future]]] = []

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K and V, each ``[kv_heads, n_tokens, head_dim]``."""
        lay = self.layout
        expect = (lay.n_kv_heads, self.n_tokens, lay.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise InvalidInput(f"layer {layer}: K/V must be {expect}, got {tuple(k.shape)}, {tuple(v.shape)}")
        self.write_layer_pages(layer, pack_layer(lay, k.detach().cpu(), v.detach().cpu()).numpy())

    def write_layer_pages(self, layer: int, arr: np.ndarray) -> None:
        """Store one layer already laid out as page-file bytes ``uint8 [kv_heads, n_pages, page_bytes]``.

        Checksums and the durable write may run in the background until ``commit``: ``arr`` must not
        change until then; a failure raises from a later ``write_layer_pages`` or from ``commit``."""
        lay = self.layout
        expect = (lay.n_kv_heads, lay.n_pages(self.n_tokens), lay.page_bytes)
        if arr.dtype != np.uint8 or tuple(arr.shape) != expect:
            raise InvalidInput(f"layer {layer}: pages must be uint8 {expect}, got {arr.dtype} {tuple(arr.shape)}")
        if not 0 <= layer < lay.n_layers:
            raise InvalidInput(f"layer {layer} out of range [0, {lay.n_layers})")
        name = layer_file_name(layer)
        # Bounded pipeline: at most MAX_PENDING_LAYERS layers' bytes are held while being written.
        self._drain(MAX_PENDING_LAYERS - 1)
        digest_job = self._run(functools.partial(bytes_digest, arr))
        other_jobs = [self._run(functools.partial(write_bytes_durably, self.tmp_dir / name, arr,
                                                  self.store.config.fsync)),
                      *(self._run(functools.partial(self._page_crcs, layer, arr, h)) for h in range(lay.n_kv_heads))]
        self._pending.append((layer, name, arr.nbytes, digest_job, other_jobs))

    def _run(self, job: Callable[[], object]) -> Future:
        """``job`` on the writer's threads, or now on this one when it has none."""
        if self._pool is not None:
            return self._pool.submit(job)
        done: Future = Future()
        done.set_result(job())
        return done

    def _page_crcs(self, layer: int, arr: np.ndarray, head: int) -> None:
        for p in range(arr.shape[1]):
            self._crc[layer, head, p] = page_crc(self.prefix_id, layer, head, p, memoryview(arr[head, p]))

    def _drain(self, keep: int) -> None:
        """Wait for pending layer writes until at most ``keep`` remain; the first failure raises."""
        while len(self._pending) > keep:
            layer, name, size, digest_job, other_jobs = self._pending.pop(0)
            for f in other_jobs:
                f.result()
            self._files[layer] = FileInfo(name=name, size=size, blake2b=str(digest_job.result()))

    def put_artifact(self, name: str, data: bytes) -> None:
        """Stage a small artifact (committed together with the manifest)."""
        if not name or name == PAGE_CRC_ARTIFACT:
            raise InvalidInput(f"invalid artifact name {name!r}")
        self._artifacts[name] = data

    def commit(self) -> Manifest:
        """Make the prefix durable and visible: pages renamed into place, then the manifest."""
        self._drain(0)
        self._shutdown()
        missing = sorted(set(range(self.layout.n_layers)) - set(self._files))
        if missing:
            raise InvalidInput(f"cannot commit: layers {missing} were not written")
        arts = dict(self._artifacts)
        arts[PAGE_CRC_ARTIFACT] = self._crc.tobytes()
        final = self.store.prefix_dir(self.prefix_id)
        if final.exists():  # left over by a crash before its manifest was committed
            shutil.rmtree(final)
        os.rename(self.tmp_dir, final)
        if self.store.config.fsync:
            fsync_dir(self.store.prefixes_dir)
        manifest = Manifest(
            prefix_id=self.prefix_id, key=self.key, model_name=self.model_name, n_tokens=self.n_tokens,
            files=tuple(self._files[i] for i in range(self.layout.n_layers)),
            artifacts=tuple(ArtifactInfo(name=n, size=len(b), blake2b=digest(b)) for n, b in sorted(arts.items())),
            created_at=time.time(), tenant=self.tenant,
        )
        self.store._commit(manifest, arts)
        return manifest

    def abort(self) -> None:
        """Discard everything written so far."""
        for *_, digest_job, other_jobs in self._pending:
            for f in (digest_job, *other_jobs):
                f.cancel()
        self._shutdown()  # running writes finish before their files are removed
        self._pending.clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
