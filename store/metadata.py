"""Metadata backends: manifests and small artifacts. LMDB is the embedded default."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path

import lmdb

from store.errors import StoreUnavailable
from store.manifest import Manifest


class MetadataBackend(abc.ABC):
    """Where manifests and small artifacts live; a commit is atomic and durable."""

    @abc.abstractmethod
    def commit(self, manifest: Manifest, artifacts: Mapping[str, bytes]) -> None:
        """Atomically store a prefix's artifacts and then make its manifest visible."""

    @abc.abstractmethod
    def manifest(self, prefix_id: str) -> Manifest | None:
        """The committed manifest, or None."""

    @abc.abstractmethod
    def manifests(self) -> list[Manifest]:
        """Every committed manifest."""

    @abc.abstractmethod
    def artifact(self, prefix_id: str, name: str) -> bytes | None:
        """The bytes of one artifact, or None."""

    @abc.abstractmethod
    def delete(self, prefix_id: str) -> bool:
        """Remove a prefix's manifest and artifacts; False when it did not exist."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources."""


def _artifact_key(prefix_id: str, name: str) -> bytes:
    return f"{prefix_id}/{name}".encode()


class LmdbMetadata(MetadataBackend):
    """Manifests and artifacts in one LMDB environment (one write transaction per commit)."""

    def __init__(self, path: Path, map_size: int) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True)
        except (OSError, lmdb.Error) as e:
            raise StoreUnavailable(f"cannot open metadata store at {path}: {e}") from e
        self._manifests = self._env.open_db(b"manifests")
        self._artifacts = self._env.open_db(b"artifacts")

    def commit(self, manifest: Manifest, artifacts: Mapping[str, bytes]) -> None:
        """Write artifacts and manifest in one transaction: either all are visible or none."""
        pid = manifest.prefix_id
        try:
            with self._env.begin(write=True) as txn:
                for name, data in artifacts.items():
                    txn.put(_artifact_key(pid, name), data, db=self._artifacts)
                txn.put(pid.encode(), manifest.to_json().encode(), db=self._manifests)
        except lmdb.Error as e:
            raise StoreUnavailable(f"metadata commit failed: {e}") from e

    def manifest(self, prefix_id: str) -> Manifest | None:
        """The committed manifest, or None."""
        with self._env.begin() as txn:
            raw = txn.get(prefix_id.encode(), db=self._manifests)
        return None if raw is None else Manifest.from_json(bytes(raw))

    def manifests(self) -> list[Manifest]:
        """Every committed manifest."""
        with self._env.begin() as txn:
            return [Manifest.from_json(bytes(v)) for _, v in txn.cursor(db=self._manifests)]

    def artifact(self, prefix_id: str, name: str) -> bytes | None:
        """The bytes of one artifact, or None."""
        with self._env.begin() as txn:
            raw = txn.get(_artifact_key(prefix_id, name), db=self._artifacts)
        return None if raw is None else bytes(raw)

    def delete(self, prefix_id: str) -> bool:
        """Remove manifest and artifacts in one transaction."""
        prefix = f"{prefix_id}/".encode()
        with self._env.begin(write=True) as txn:
            existed = txn.delete(prefix_id.encode(), db=self._manifests)
            cur = txn.cursor(db=self._artifacts)
            if cur.set_range(prefix):
                while cur.key().startswith(prefix):
                    if not cur.delete():
                        break
        return bool(existed)

    def close(self) -> None:
        """Close the environment."""
        self._env.close()
