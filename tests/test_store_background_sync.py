"""A prefill commits once its files are written and a background thread fsyncs them after
(``StoreConfig.sync_after_commit``, the default): served at once, on the disk soon after, and after a crash in
between every such prefix is verified in full at the next start (kept when whole, removed when damaged)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_store import _key, _kv, _write

from services.store_flags import add_store_limit_args, store_limits
from store import disk_record, recovery
from store.config import StoreConfig
from store.disk_record import UNSYNCED_FILE
from store.errors import PrefixNotFound
from store.kvstore import KVStore
from store.pages import layer_file_name, pack_layer


def _open(home: Path, **kw: object) -> KVStore:
    return KVStore(StoreConfig(home=home, page_size=16, **kw))  # type: ignore[arg-type]


class Gates:
    """``disk_record.sync_tree`` held until told: call ``i`` waits for gate ``i``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int = 4) -> None:
        self.gates = [threading.Event() for _ in range(n)]
        self.started: list[Path] = []
        real = disk_record.sync_tree

        def held(directory: Path, parent: Path) -> None:
            if not threading.current_thread().name.startswith("kvstash-sync"):  # a start's recovery: not held
                return real(directory, parent)
            i = len(self.started)
            self.started.append(directory)
            self.gates[i].wait(timeout=30)
            real(directory, parent)

        monkeypatch.setattr(disk_record, "sync_tree", held)

    def open_all(self) -> None:
        for g in self.gates:
            g.set()


def _crash(store: KVStore) -> None:
    """What a dead process leaves: its metadata handle gone (LMDB opens once per process), its sync undone."""
    store._meta.close()


def _after_crash(store: KVStore, gates: Gates) -> None:
    """Let the dead store's held sync thread finish (on whatever is left) and stop it."""
    gates.open_all()
    store._syncer.close()


@pytest.fixture()
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gates]:
    g = Gates(monkeypatch)
    yield g
    g.open_all()  # never leave the sync thread waiting


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync from now on, as (thread name, file name)."""
    calls: list[tuple[str, str]] = []
    real: Callable[[int], None] = os.fsync

    def recorded(fd: int) -> None:
        calls.append((threading.current_thread().name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    return calls


def test_a_prefix_is_served_before_it_is_synced_then_synced_in_the_background(
        tmp_path: Path, gates: Gates, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _open(tmp_path / "home")
    assert store.config.fsync and store.config.sync_after_commit  # the default
    fsyncs = _fsyncs(monkeypatch)
    pid, kv = _write(store, 40)
    d = store.prefix_dir(pid)
    pages = {layer_file_name(i) for i in range(3)}
    # Committed and readable while its sync waits; no page file was fsync'd on the writer's way.
    assert (d / UNSYNCED_FILE).is_file() and store.unsynced() == 1
    k, v = store.read_layer(pid, 1, verify=True)
    assert torch.equal(k, kv[1][0]) and torch.equal(v, kv[1][1])
    assert not pages & {name for _, name in fsyncs}
    gates.open_all()
    assert store.flush(timeout=30) and store.unsynced() == 0
    assert not (d / UNSYNCED_FILE).exists()
    by_sync = {name for thread, name in fsyncs if thread.startswith("kvstash-sync")}
    assert pages <= by_sync and disk_record.MANIFEST_FILE in by_sync
    store.close()


def test_streamed_layers_are_synced_after_the_commit_too(tmp_path: Path, gates: Gates,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store service's path (each layer streamed to its file as its bytes arrive) fsyncs no page file on
    the writer's way either; the background sync does."""
    store = _open(tmp_path / "home")
    fsyncs = _fsyncs(monkeypatch)
    key, kv = _key(40), _kv(40)
    with store.write_prefix(key, model_name="m", n_tokens=40) as w:
        assert not w.fsyncs_each_file
        for layer, (k, v) in enumerate(kv):
            data = pack_layer(key.layout, k, v).numpy().tobytes()
            with contextlib.closing(w.open_layer(layer)) as stream:
                for off in range(0, len(data), 1000):
                    stream.write(data[off:off + 1000])
        w.commit()
    pages = {layer_file_name(i) for i in range(3)}
    assert not pages & {name for _, name in fsyncs}
    gates.open_all()
    assert store.flush(timeout=30)
    assert pages <= {name for thread, name in fsyncs if thread.startswith("kvstash-sync")}
    k2, v2 = store.read_layer(key.prefix_id, 2, verify=True)
    assert torch.equal(k2, kv[2][0]) and torch.equal(v2, kv[2][1])
    store.close()


def test_sync_before_commit_fsyncs_every_file_before_the_prefix_is_visible(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _open(tmp_path / "home", sync_after_commit=False)
    fsyncs = _fsyncs(monkeypatch)
    pid, _ = _write(store, 40)
    assert {layer_file_name(i) for i in range(3)} <= {name for _, name in fsyncs}
    assert not any(thread.startswith("kvstash-sync") for thread, _ in fsyncs)
    assert not (store.prefix_dir(pid) / UNSYNCED_FILE).exists() and store.unsynced() == 0
    store.close()


def test_close_waits_for_the_background_sync(tmp_path: Path) -> None:
    store = _open(tmp_path / "home")
    pids = [_write(store, 20 + i, seed=i)[0] for i in range(3)]
    store.close()
    assert not any((store.prefix_dir(p) / UNSYNCED_FILE).exists() for p in pids)


@pytest.mark.parametrize("damage", ["none", "page_flipped", "page_truncated", "manifest_lost"])
@pytest.mark.parametrize("metadata_lost", [False, True])
def test_a_start_after_a_crash_verifies_unsynced_prefixes(tmp_path: Path, gates: Gates, damage: str,
                                                          metadata_lost: bool) -> None:
    """The writer stopped before its background fsync (its thread held here, never released before the new
    start); what a power loss may have done to the files is simulated; the next start keeps a whole prefix (and
    syncs it) and removes a damaged one, metadata first, so it is never served."""
    home = tmp_path / "home"
    crashed = _open(home)
    pid, kv = _write(crashed, 40)
    other, _ = _write(crashed, 24, seed=5)  # queued behind it: also unsynced
    d = crashed.prefix_dir(pid)
    assert (d / UNSYNCED_FILE).is_file() and (crashed.prefix_dir(other) / UNSYNCED_FILE).is_file()
    if damage == "page_flipped":
        with open(d / layer_file_name(2), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "page_truncated":
        os.truncate(d / layer_file_name(0), 4096)
    elif damage == "manifest_lost":
        os.unlink(d / disk_record.MANIFEST_FILE)
    if metadata_lost:
        crashed._meta.delete(pid)
    _crash(crashed)
    restarted = _open(home)  # its recovery runs now
    report = restarted.recover()  # a second start finds nothing left to do
    assert report.names(recovery.UNSYNCED) == []
    if damage == "none" or (damage == "manifest_lost" and not metadata_lost):  # the files are whole; the
        assert not (d / UNSYNCED_FILE).exists()  # metadata's manifest describes them (written back to the dir)
        assert disk_record.read_manifest(d) == restarted.manifest(pid)
        k, v = restarted.read_layer(pid, 2, verify=True)
        assert torch.equal(k, kv[2][0]) and torch.equal(v, kv[2][1])
        restarted.verify(pid)
    else:
        assert not d.exists() and pid not in {m.prefix_id for m in restarted.list_prefixes()}
        with pytest.raises(PrefixNotFound):
            restarted.manifest(pid)
    restarted.verify(other)  # the whole one next to it is kept either way
    assert not (restarted.prefix_dir(other) / UNSYNCED_FILE).exists()
    _after_crash(crashed, gates)  # the old writer's thread wakes up: a removed directory is no error
    restarted.close()


def test_recovery_reports_what_it_did_with_unsynced_prefixes(tmp_path: Path, gates: Gates) -> None:
    """The start's report lists each unsynced prefix it settled, fixed, with what was done; a second start finds
    nothing left to do; the setting of the new start does not matter."""
    home = tmp_path / "home"
    crashed = _open(home)
    kept, _ = _write(crashed, 40)
    lost, _ = _write(crashed, 24, seed=3)
    os.truncate(crashed.prefix_dir(lost) / layer_file_name(1), 10)
    _crash(crashed)
    fresh = KVStore(StoreConfig(home=home, page_size=16, sync_after_commit=False), recover=False)
    report = fresh.recover()
    assert sorted(report.names(recovery.UNSYNCED)) == sorted([kept, lost])
    details = {p.name: p.detail for p in report.problems}
    assert "made durable" in details[kept] and "removed" in details[lost]
    assert report.ok and all(p.fixed for p in report.problems) and report.prefixes == 1
    again = fresh.recover()
    assert again.ok and again.problems == () and again.prefixes == 1
    assert [m.prefix_id for m in fresh.list_prefixes()] == [kept]
    _after_crash(crashed, gates)
    fresh.close()


def test_a_prefix_removed_before_its_sync_is_not_brought_back(tmp_path: Path, gates: Gates) -> None:
    store = _open(tmp_path / "home")
    pid, _ = _write(store, 40)
    store.remove(pid)
    gates.open_all()
    assert store.flush(timeout=30)
    assert not store.prefix_dir(pid).exists() and store.list_prefixes() == []
    store.close()


def test_an_older_sync_leaves_the_marker_of_a_newer_directory_of_the_same_prefix(tmp_path: Path,
                                                                                 gates: Gates) -> None:
    """Written, removed and written again while the first sync waits: the first sync (which runs over the new
    directory, at the same path) must not clear the new directory's marker; the second does."""
    store = _open(tmp_path / "home")
    pid, _ = _write(store, 40)
    store.remove(pid)
    pid2, _ = _write(store, 40)
    assert pid2 == pid
    d = store.prefix_dir(pid)
    gates.gates[0].set()
    for _ in range(3000):  # the second sync has started (and waits at its gate): the first is done
        if len(gates.started) == 2:
            break
        threading.Event().wait(0.01)
    assert len(gates.started) == 2
    assert (d / UNSYNCED_FILE).is_file()
    gates.gates[1].set()
    assert store.flush(timeout=30)
    assert not (d / UNSYNCED_FILE).exists()
    store.close()


def test_servers_take_the_durability_flag() -> None:
    p = argparse.ArgumentParser()
    add_store_limit_args(p)
    assert store_limits(p.parse_args([]))["sync_after_commit"] is True
    assert store_limits(p.parse_args(["--sync-before-commit"]))["sync_after_commit"] is False
    StoreConfig(home=Path("/nonexistent"), **store_limits(p.parse_args(["--sync-before-commit"])))


def test_a_process_killed_before_its_background_sync_loses_nothing(tmp_path: Path) -> None:
    """A real process commits two prefixes, its sync thread never finishes, and it dies (``os._exit``, no
    clean-up); the next process's store lists both, reads them back whole, and has synced them."""
    home = tmp_path / "home"
    script = f"""
import os, sys, threading
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).resolve().parents[1])!r}]
from pathlib import Path
from store import disk_record
from store.config import StoreConfig
from store.kvstore import KVStore
from test_store import _write
disk_record.sync_tree = lambda d, p: threading.Event().wait()  # the sync thread never gets to the disk
store = KVStore(StoreConfig(home=Path({str(home)!r}), page_size=16))
print(_write(store, 40)[0], _write(store, 24, seed=5)[0], flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pids = out.stdout.split()
    assert len(pids) == 2
    assert all((home / "prefixes" / p / UNSYNCED_FILE).is_file() for p in pids)  # died before the sync
    store = _open(home)  # recovery verifies them
    assert {m.prefix_id for m in store.list_prefixes()} == set(pids)
    for p in pids:
        store.verify(p)
        assert not (store.prefix_dir(p) / UNSYNCED_FILE).exists()
    for layer, (k, v) in enumerate(_kv(24, seed=5)):  # what the dead process wrote, byte for byte
        k2, v2 = store.read_layer(pids[1], layer, verify=True)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    store.close()
