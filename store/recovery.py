"""Metadata is an index of the disk: registering what it lost at start (``recover``), and
``kvstash store check [--repair]`` (``check``), which compares the two in full.

Both walk ``prefixes/``. A directory named like a prefix id with a valid manifest file
(``store.disk_record``) is a committed prefix whatever the metadata says; ``recover`` never deletes
one that was on the disk (nor any other prefix directory: only temp dirs of dead writers, and prefixes still
marked unsynced that fail their checksums: a power loss took them before their background fsync), ``check``
only when told to repair
a prefix it cannot serve (page or artifact files missing, the wrong size or failing their checksums: the
directory holds the only copy of both, so nothing can restore them; prefill it again).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from store import disk_record
from store.disk_record import InvalidRecord
from store.errors import InvalidInput, LockTimeout
from store.manifest import Manifest
from store.page_files_check import page_files_problem
from store.prefix_key import check_prefix_id
from store.writer import TMP_PREFIX

if TYPE_CHECKING:
    from store.config import StoreConfig
    from store.metadata import MetadataBackend


class StoreRoom(Protocol):
    """What recovery and checking need of a store (``KVStore`` is one): its directories, locks, metadata
    backend and the steps that drop a prefix. Typed here so this module does not import ``store.kvstore``."""

    config: StoreConfig
    prefixes_dir: Path
    _meta: MetadataBackend

    def prefix_dir(self, prefix_id: str) -> Path: ...

    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *,
                     wait_s: float | None = None) -> contextlib.AbstractContextManager[None]: ...

    def _host_lock(self, name: str, blocking: bool) -> contextlib.AbstractContextManager[bool]: ...

    def _unregister(self, m: Manifest) -> None: ...

    def _drop_dir(self, prefix_id: str) -> None: ...

log = logging.getLogger(__name__)

STALE_TEMP = "stale_temp"
"""A temp dir of a writer that is gone. Repair (and every start) removes it."""
ORPHAN = "orphan"
"""A directory that is no committed prefix and unknown to the metadata. Repair removes it."""
UNREGISTERED = "unregistered"
"""A committed directory the metadata does not list. Repair (and every start) registers it."""
DANGLING = "dangling"
"""A metadata entry whose directory, page files or artifact files are missing or the wrong size. Repair drops it
(and what is left of its directory)."""
CORRUPT = "corrupt"
"""A prefix whose page or artifact files fail their checksums. Repair removes it (prefill it again)."""
UNSYNCED = "unsynced"
"""A committed prefix whose background fsync had not finished when its writer stopped. Every start verifies it in
full: made durable when whole, removed (metadata first) when a crash lost any of its bytes."""
UNRECORDED = "unrecorded"
"""A registered prefix whose page and artifact files match the metadata's manifest, but whose directory lacks
that manifest file (missing, damaged or another one). Repair writes it from the metadata's manifest."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing metadata and disk disagree on."""

    kind: str
    name: str
    """The prefix id, or the directory's name under ``prefixes/``."""
    detail: str
    fixed: bool = False


@dataclass(frozen=True, kw_only=True)
class CheckReport:
    """What ``recover`` or ``check`` found (and, with repair, fixed)."""

    prefixes: int
    """Committed prefixes found healthy (or made healthy) and registered."""
    problems: tuple[Problem, ...] = ()
    busy: tuple[str, ...] = ()
    """Prefixes skipped because a writer or evictor held them."""
    repaired: bool = False

    @property
    def ok(self) -> bool:
        """Whether no problem remains."""
        return all(p.fixed for p in self.problems)

    def names(self, kind: str) -> list[str]:
        """Names of the problems of one kind."""
        return [p.name for p in self.problems if p.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"ok": self.ok, "prefixes": self.prefixes, "repaired": self.repaired, "busy": list(self.busy),
                "problems": [asdict(p) for p in self.problems]}


def _is_prefix_id(name: str) -> bool:
    try:
        check_prefix_id(name)
    except InvalidInput:
        return False
    return True


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _held(store: StoreRoom, prefix_id: str) -> Iterator[bool]:
    """The prefix's prefill lock without waiting; yields whether it was taken (busy otherwise)."""
    try:
        with store.prefill_lock(prefix_id, wait_s=0):
            yield True
    except LockTimeout:
        yield False


def _temp(store: StoreRoom, entry: Path, repair: bool) -> Problem | None:
    """A writer's temp dir: a problem when its writer is gone (removed with ``repair``), None while it lives."""
    owner = entry.name[len(TMP_PREFIX):].split("-")[0]
    if not _is_prefix_id(owner):
        if repair:
            _remove_path(entry)
        return Problem(kind=STALE_TEMP, name=entry.name, detail="temp dir of no prefix", fixed=repair)
    with store._host_lock(owner, blocking=False) as taken:
        if not taken:
            return None  # a live writer owns it
        if repair:
            _remove_path(entry)
    return Problem(kind=STALE_TEMP, name=entry.name, detail="temp dir of a writer that is gone", fixed=repair)


def _register(store: StoreRoom, directory: Path) -> Problem | None:
    """Register a committed directory the metadata lacks (caller holds its lock); a problem when it is none."""
    if store._meta.manifest(directory.name) is not None:
        return None  # registered meanwhile
    try:
        m = disk_record.load_record(directory)
    except InvalidRecord as e:
        return Problem(kind=ORPHAN, name=directory.name, detail=str(e))
    store._meta.commit(m)
    _restore_pin(store, directory)
    return Problem(kind=UNREGISTERED, name=directory.name, detail="registered from its directory", fixed=True)


def _restore_pin(store: StoreRoom, directory: Path) -> None:
    """Pin a just-registered prefix again when its directory says it was pinned."""
    if disk_record.is_marked_pinned(directory):
        store._meta.pin(directory.name)


def _settle_unsynced(store: StoreRoom, directory: Path) -> Problem | None:
    """A committed directory still marked unsynced (caller holds its lock): verified in full, then made durable;
    removed (its metadata first) when any file is missing or damaged. None when it was synced meanwhile."""
    if not disk_record.is_marked_unsynced(directory):
        return None
    registered = store._meta.manifest(directory.name)
    try:
        recorded, bad = disk_record.read_manifest(directory), None
    except InvalidRecord as e:
        recorded, bad = None, str(e)
    m = registered or recorded
    if m is not None:
        bad = disk_record.file_problem(directory, m) or _hash_problem(directory, m, hash_pages=True)
    if bad is None:
        if registered is not None and recorded != registered:  # the crash took its manifest file: written back
            disk_record.publish(directory, registered, fsync=False)  # (the files match it: checked above)
        disk_record.sync_tree(directory, store.prefixes_dir)
        disk_record.clear_unsynced(directory)
        return Problem(kind=UNSYNCED, name=directory.name, fixed=True,
                       detail="its writer stopped before the background fsync: verified whole, made durable")
    if registered is not None:
        store._unregister(registered)
    store._drop_dir(directory.name)
    return Problem(kind=UNSYNCED, name=directory.name, fixed=True,
                   detail=f"lost before its background fsync ({bad}): removed, prefill it again")


def recover(store: StoreRoom) -> CheckReport:
    """See ``KVStore.recover``."""
    known = set(store._meta.prefix_ids())
    problems: list[Problem] = []
    busy: list[str] = []
    on_disk: set[str] = set()
    unknown: list[tuple[float, Path]] = []
    for entry in store.prefixes_dir.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            if (p := _temp(store, entry, repair=True)) is not None:
                problems.append(p)
        elif not _is_prefix_id(entry.name) or not entry.is_dir():
            problems.append(Problem(kind=ORPHAN, name=entry.name, detail="not a prefix directory"))
        else:
            if disk_record.is_marked_unsynced(entry):
                with _held(store, entry.name) as taken:
                    settled = _settle_unsynced(store, entry) if taken else None
                if not taken:
                    busy.append(entry.name)
                if settled is not None:
                    problems.append(settled)
                if not entry.exists():  # lost in a crash, and removed
                    known.discard(entry.name)
                    continue
            on_disk.add(entry.name)
            if entry.name not in known:
                try:
                    unknown.append((disk_record.read_manifest(entry).created_at, entry))
                except InvalidRecord as e:
                    problems.append(Problem(kind=ORPHAN, name=entry.name, detail=str(e)))
    for _, entry in sorted(unknown):  # oldest first: the least recently used order follows creation
        with _held(store, entry.name) as taken:
            if not taken:
                busy.append(entry.name)
            elif (p := _register(store, entry)) is not None:
                problems.append(p)
    if synced := [p for p in problems if p.kind == UNSYNCED]:
        log.warning("%d prefixes were committed but not yet on the disk when their writer stopped: verified "
                    "(removed when damaged): %s", len(synced), "; ".join(f"{p.name}: {p.detail}" for p in synced))
    registered = [p for p in problems if p.kind == UNREGISTERED]
    if registered:
        log.warning("registered %d committed prefixes the metadata did not list, from their directories under %s",
                    len(registered), store.prefixes_dir)
    unfixed = [p for p in problems if not p.fixed]
    if unfixed:
        log.warning("%d entries under %s are no committed prefix (first: %s: %s); `kvstash store check --repair` "
                    "removes them", len(unfixed), store.prefixes_dir, unfixed[0].name, unfixed[0].detail)
    if missing := len(known - on_disk):
        log.warning("%d prefixes in the metadata have no directory under %s; `kvstash store check` lists them",
                    missing, store.prefixes_dir)
    healthy = len(known & on_disk) + len(registered)
    return CheckReport(prefixes=healthy, problems=tuple(problems), busy=tuple(busy))


def _hash_problem(directory: Path, m: Manifest, hash_pages: bool) -> str | None:
    """Page files (when ``hash_pages``) and artifact files (always: they are the summaries a decode reads whole)
    that fail their checksums."""
    if hash_pages and (bad := page_files_problem(directory, m)) is not None:
        return bad
    return disk_record.artifact_problem(directory, m)


def _check_unregistered(store: StoreRoom, d: Path, repair: bool, hash_pages: bool) -> Problem:
    try:
        m = disk_record.load_record(d)
    except InvalidRecord as e:
        if repair:
            _remove_path(d)
        return Problem(kind=ORPHAN, name=d.name, detail=str(e), fixed=repair)
    if (bad := _hash_problem(d, m, hash_pages)) is not None:
        if repair:
            _remove_path(d)
        return Problem(kind=CORRUPT, name=d.name, detail=f"{bad} (not registered)", fixed=repair)
    if repair:
        store._meta.commit(m)
        _restore_pin(store, d)
    return Problem(kind=UNREGISTERED, name=d.name, detail="committed directory the metadata does not list",
                   fixed=repair)


def _check_registered(store: StoreRoom, d: Path, m: Manifest, repair: bool, hash_pages: bool) -> Problem | None:
    def drop() -> bool:
        if repair:
            store._unregister(m)
            store._drop_dir(m.prefix_id)
        return repair

    if (bad := disk_record.file_problem(d, m)) is not None:
        return Problem(kind=DANGLING, name=d.name, detail=bad, fixed=drop())
    if (bad := _hash_problem(d, m, hash_pages)) is not None:
        return Problem(kind=CORRUPT, name=d.name, detail=bad, fixed=drop())
    try:
        if disk_record.read_manifest(d) == m:
            return None
        disk_error = "on-disk manifest differs from the metadata's"
    except InvalidRecord as e:
        disk_error = str(e)
    if repair:  # its files match the metadata's manifest (checked above): that manifest describes the directory
        disk_record.publish(d, m, fsync=store.config.fsync)
    return Problem(kind=UNRECORDED, name=d.name, detail=disk_error, fixed=repair)


def check(store: StoreRoom, *, repair: bool, hash_pages: bool) -> CheckReport:
    """See ``KVStore.check``."""
    meta = store._meta
    ids = set(meta.prefix_ids())
    problems: list[Problem] = []
    busy: list[str] = []
    seen: set[str] = set()
    healthy = 0
    for entry in sorted(store.prefixes_dir.iterdir()):
        if entry.name.startswith(TMP_PREFIX):
            if (p := _temp(store, entry, repair)) is not None:
                problems.append(p)
            continue
        if not _is_prefix_id(entry.name) or not entry.is_dir():
            if repair:
                _remove_path(entry)
            problems.append(Problem(kind=ORPHAN, name=entry.name, detail="not a prefix directory", fixed=repair))
            continue
        seen.add(entry.name)
        with _held(store, entry.name) as taken:
            if not taken:
                busy.append(entry.name)
                continue
            m = meta.manifest(entry.name)
            p = (_check_unregistered(store, entry, repair, hash_pages) if m is None
                 else _check_registered(store, entry, m, repair, hash_pages))
        if p is None or (p.fixed and p.kind in (UNREGISTERED, UNRECORDED)):
            healthy += 1
        if p is not None:
            problems.append(p)
    for pid in sorted(ids - seen):
        with _held(store, pid) as taken:
            if not taken:
                busy.append(pid)
                continue
            if meta.manifest(pid) is None or store.prefix_dir(pid).exists():
                continue  # removed, or written, since the listing
            if repair:
                meta.delete(pid)
            problems.append(Problem(kind=DANGLING, name=pid, detail="directory missing", fixed=repair))
    return CheckReport(prefixes=healthy, problems=tuple(problems), busy=tuple(busy), repaired=repair)
