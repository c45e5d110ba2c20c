"""The self-describing prefix directory: manifest and artifacts as files inside it, the manifest last.

Metadata backends are an index (manifests, LRU, leases, pins; never artifact bytes): everything needed to
register a prefix again (after Redis lost its data, or an LMDB file was deleted or damaged) is in
``prefixes/<id>/``, and artifacts are read from there only::

    layer_NNN.kv       page files (``store.pages``)
    artifact_NNN.bin   artifact i of the manifest (sorted by name; names never become file names; the one
                       copy: a missing or damaged one makes a damaged prefix, like a page file)
    manifest.json      {"format", "manifest": <Manifest JSON>, "blake2b": <digest of that JSON>}
    pinned             present while the prefix is pinned (empty; so a pin survives metadata loss)
    unsynced           present while the prefix's files may not be on the disk yet (``StoreConfig.sync_after_commit``:
                       made durable before anything else is written, removed once every file and the directory
                       are fsync'd; a start after a crash verifies such a prefix in full, and drops it if it fails)

``manifest.json`` is written last (temp file, fsync, rename, fsync of the directory), before the
directory itself is renamed into place: a directory with a valid manifest is a committed prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from store.artifacts import digest
from store.hashed_read import HashedRead
from store.manifest import Manifest
from store.pages import HASH_CHUNK, layer_file_name

MANIFEST_FILE = "manifest.json"
PIN_FILE = "pinned"
UNSYNCED_FILE = "unsynced"
RECORD_FORMAT = 1
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest file larger than this is not one of ours (read no further)."""


class InvalidRecord(Exception):
    """A prefix directory that does not describe a committed prefix; the message says why."""


def artifact_file_name(index: int) -> str:
    """File name of the manifest's ``index``-th artifact."""
    return f"artifact_{index:03d}.bin"


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | memoryview, fsync: bool) -> None:
    """Write ``data`` to a new file at ``path`` (fsync'd when ``fsync``)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def publish(directory: Path, manifest: Manifest, *, fsync: bool) -> None:
    """Write ``directory``'s manifest file (temp file, fsync, rename, fsync of the directory)."""
    text = manifest.to_json()
    record = json.dumps({"format": RECORD_FORMAT, "manifest": text, "blake2b": digest(text.encode())})
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    write_file(tmp, record.encode(), fsync)
    os.replace(tmp, directory / MANIFEST_FILE)
    if fsync:
        fsync_dir(directory)


def unpublish(directory: Path, *, fsync: bool) -> None:
    """Remove a directory's manifest file, so that it is no longer a committed prefix (nothing if absent)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / MANIFEST_FILE)
        if fsync:
            fsync_dir(directory)


def mark_pinned(directory: Path, pinned: bool, *, fsync: bool) -> None:
    """Create or remove ``directory``'s pin marker (durably when ``fsync``)."""
    path = directory / PIN_FILE
    if pinned:
        write_file(path, b"", fsync)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
    if fsync:
        fsync_dir(directory)


def mark_unsynced(directory: Path) -> str:
    """Durably mark ``directory`` as not yet on the disk (before any other file of it is written); the marker's
    token (random), so that only the sync of this very directory removes it, not one of an older directory of
    the same name."""
    token = os.urandom(16).hex()
    write_file(directory / UNSYNCED_FILE, token.encode(), fsync=True)
    fsync_dir(directory)
    return token


def is_marked_unsynced(directory: Path) -> bool:
    """Whether ``directory`` holds the marker of files that may not be on the disk."""
    return (directory / UNSYNCED_FILE).is_file()


def sync_tree(directory: Path, parent: Path) -> None:
    """fsync every file of ``directory``, the directory, and ``parent`` (which holds its name)."""
    for entry in directory.iterdir():
        if entry.is_file() and not entry.is_symlink():
            try:
                fd = os.open(entry, os.O_RDONLY)
            except FileNotFoundError:  # removed since the listing (the marker, by another sync)
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)
    fsync_dir(parent)


def clear_unsynced(directory: Path, token: str | None = None) -> bool:
    """Remove the unsynced marker once ``sync_tree`` ran (only the marker holding ``token`` when given: a newer
    directory of the same name keeps its own); whether it was removed."""
    path = directory / UNSYNCED_FILE
    try:
        if token is not None:
            with open(path, "rb") as f:
                if f.read(len(token) + 1) != token.encode():
                    return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(directory)
    return True


def is_marked_pinned(directory: Path) -> bool:
    """Whether ``directory`` holds a pin marker."""
    return (directory / PIN_FILE).is_file()


def read_manifest(directory: Path) -> Manifest:
    """The manifest a prefix directory holds, checked against its digest and the directory's name;
    InvalidRecord otherwise. Reads nothing but the manifest file."""
    path = directory / MANIFEST_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise InvalidRecord("no manifest file") from None
    except OSError as e:
        raise InvalidRecord(f"manifest file unreadable: {e.strerror or e}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise InvalidRecord("manifest file too large")
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
            raise InvalidRecord("unknown manifest file format")
        text = record["manifest"]
        if not isinstance(text, str) or digest(text.encode()) != record.get("blake2b"):
            raise InvalidRecord("manifest file failed its checksum")
        m = Manifest.from_json(text)
    except InvalidRecord:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidRecord(f"manifest file does not parse: {type(e).__name__}") from None
    if m.prefix_id != directory.name or m.key.prefix_id != m.prefix_id or m.state != "committed":
        raise InvalidRecord("manifest is not the one of this directory")
    lay = m.layout
    expect = [(layer_file_name(i), lay.layer_file_bytes(m.n_tokens)) for i in range(lay.n_layers)]
    if [(f.name, f.size) for f in m.files] != expect:
        raise InvalidRecord("manifest lists page files its layout does not give")
    return m


def file_problem(directory: Path, manifest: Manifest) -> str | None:
    """What is wrong with the presence and sizes of the page and artifact files (a stat each, no reads), or None."""
    for f in manifest.files:
        try:
            size = (directory / f.name).stat().st_size
        except FileNotFoundError:
            return f"page file {f.name} is missing"
        if size != f.size:
            return f"page file {f.name} has {size} bytes, not {f.size}"
    for i, a in enumerate(manifest.artifacts):
        try:
            size = (directory / artifact_file_name(i)).stat().st_size
        except FileNotFoundError:
            return f"artifact {a.name!r} ({artifact_file_name(i)}) is missing"
        if size != a.size:
            return f"artifact {a.name!r} ({artifact_file_name(i)}) has {size} bytes, not {a.size}"
    return None


class ArtifactRead:
    """An artifact's bytes being read and hashed in the background (``store.hashed_read``): ``wait_for`` gives
    the bytes that have arrived, unchecked; ``data`` the whole, checked against the manifest (``fail``'s error,
    InvalidRecord by default, otherwise)."""

    def __init__(self, read: HashedRead, name: str, size: int, blake2b: str,
                 fail: Callable[[str], Exception] = InvalidRecord):
        self._read, self.name, self.size, self._blake2b = read, name, size, blake2b
        self._fail = fail
        """Makes the error raised for a problem (the store's callers get CorruptData)."""

    @property
    def buffer(self) -> bytearray:
        """The artifact's bytes: final below ``wait_for``'s mark, unchecked until ``data`` returns."""
        return self._read.buffer

    def wait_for(self, end: int) -> None:
        """Wait until bytes ``[0, end)`` are read; InvalidRecord when the file ends sooner or cannot be read."""
        try:
            whole = self._read.wait_for(end)
        except OSError as e:
            raise self._fail(f"artifact {self.name!r} unreadable: {e.strerror or e}") from None
        if not whole:
            raise self._fail(f"artifact {self.name!r} is not {self.size} bytes long")

    def data(self) -> bytearray:
        """The whole artifact once read, checked against the manifest's size and digest (InvalidRecord)."""
        try:
            data, got = self._read.result()
        except OSError as e:
            raise self._fail(f"artifact {self.name!r} unreadable: {e.strerror or e}") from None
        if got is None:
            raise self._fail(f"artifact {self.name!r} is not {self.size} bytes long")
        if got != self._blake2b:
            raise self._fail(f"artifact {self.name!r} failed its checksum")
        return data


def start_artifact_read(directory: Path, manifest: Manifest, name: str,
                        fail: Callable[[str], Exception] = InvalidRecord) -> ArtifactRead | None:
    """The artifact ``name`` being read in the background (None when the manifest lists none); ``fail``'s error
    when its file cannot be opened. Reads at most the manifest's size + 1 bytes."""
    index = next((i for i, a in enumerate(manifest.artifacts) if a.name == name), None)
    if index is None:
        return None
    info = manifest.artifacts[index]
    try:
        read = HashedRead(directory / artifact_file_name(index), info.size)
    except OSError as e:
        raise fail(f"artifact {name!r} unreadable: {e.strerror or e}") from None
    return ArtifactRead(read, name, info.size, info.blake2b, fail)


def artifact_problem(directory: Path, manifest: Manifest) -> str | None:
    """What is wrong with the artifact files' bytes (each read, bounded, and hashed in chunks), or None."""
    for i, a in enumerate(manifest.artifacts):
        h, n = hashlib.blake2b(digest_size=32), 0
        try:
            with open(directory / artifact_file_name(i), "rb") as f:
                while n <= a.size and (chunk := f.read(min(HASH_CHUNK, a.size + 1 - n))):
                    h.update(chunk)
                    n += len(chunk)
        except OSError as e:
            return f"artifact {a.name!r} unreadable: {e.strerror or e}"
        if n != a.size or h.hexdigest() != a.blake2b:
            return f"artifact {a.name!r} ({artifact_file_name(i)}) failed its checksum"
    return None


def load_record(directory: Path) -> Manifest:
    """The manifest of a committed prefix directory, its page and artifact files stat'ed (not read); InvalidRecord
    when anything needed to register it is missing or fails its checksum."""
    m = read_manifest(directory)
    if (problem := file_problem(directory, m)) is not None:
        raise InvalidRecord(problem)
    return m
