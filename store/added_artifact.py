"""One artifact added to a committed prefix (``KVStore.add_artifact``), staged while its bytes arrive.

The bytes go to a file in a temp dir of the prefix's own (``writer.tmp_dir_name``: garbage collection removes
it if its process dies, and leaves it alone while the prefix's lock is held), so a refused or failed artifact
leaves nothing in the prefix directory; ``move_to`` puts the finished file in place at commit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from store.artifacts import ArtifactData, as_chunks
from store.manifest import ArtifactInfo
from store.writer import STAGED_PREFIX, ArtifactStream, tmp_dir_name


class StagedArtifact:
    """The ``ArtifactHome`` of one added artifact: ``check_room(size)`` raises before a write would take it to
    ``size`` bytes; a context manager that removes the temp dir (and whatever is left in it) on exit."""

    def __init__(self, prefixes_dir: Path, prefix_id: str, name: str, *, fsync: bool,
                 check_room: Callable[[int], None]) -> None:
        self.name, self._check_room = name, check_room
        self.tmp_dir = prefixes_dir / tmp_dir_name(prefix_id)
        self.tmp_dir.mkdir()
        self.path = self.tmp_dir / f"{STAGED_PREFIX}000"
        self.info: ArtifactInfo | None = None
        self._fsync = fsync

    def write_all(self, data: ArtifactData) -> ArtifactInfo:
        """Write ``data``'s chunks as they are pulled; its size and digest once all are in and flushed."""
        with ArtifactStream(self, self.name, self.path, fsync=self._fsync) as stream:
            for chunk in as_chunks(data):
                stream.write(chunk)
        assert self.info is not None  # set by the stream's close
        return self.info

    def move_to(self, path: Path) -> None:
        """Rename the written file to ``path`` (in the prefix directory: made durable by the manifest's publish)."""
        os.rename(self.path, path)

    def _check_artifact_room(self, stream: ArtifactStream, size: int) -> None:
        self._check_room(size)

    def _finish_artifact(self, stream: ArtifactStream, info: ArtifactInfo) -> None:
        self.info = info

    def _drop_artifact(self, stream: ArtifactStream) -> None:
        self.info = None

    def __enter__(self) -> StagedArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
