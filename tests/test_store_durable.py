"""Metadata is an index, not the truth: prefix directories describe themselves, a store rebuilds lost or
damaged metadata (LMDB deleted or truncated, Redis flushed) from them, ``kvstash store check [--repair]``
finds and fixes disagreements; and the store's own bounds: write sizes, lease holders, quotas, capacity."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
import torch
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from test_store import _key, _kv, _write

from client.cli import main as cli_main
from store import disk_record, recovery
from store.config import StoreConfig
from store.disk_record import MANIFEST_FILE, InvalidRecord, artifact_file_name, read_manifest
from store.errors import InvalidInput, QuotaExceeded
from store.kvstore import KVStore
from store.limits import MAX_HOLDER_BYTES, MAX_TOKENS
from workers.engine import Worker
from workers.model import LoadedModel
from workers.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def _cfg(home: Path, **kw: object) -> StoreConfig:
    return StoreConfig(home=home, page_size=16, fsync=False, **kw)  # type: ignore[arg-type]


def _fill(store: KVStore, n: int = 4) -> dict[str, list]:
    """``n`` prefixes (with an artifact each); their K/V by id."""
    return dict(_write(store, 20 + 7 * i, seed=i) for i in range(n))


def _assert_all_back(store: KVStore, written: dict[str, list]) -> None:
    """Each written prefix is listed and reads back what was written (page files, artifacts, digests)."""
    assert set(written) <= {m.prefix_id for m in store.list_prefixes()}
    for pid, kv in written.items():
        for layer, (k, v) in enumerate(kv):
            k2, v2 = store.read_layer(pid, layer, verify=True)
            assert torch.equal(k2, k) and torch.equal(v2, v)
        assert store.artifact(pid, "extra") == b"hello"
        store.verify(pid)


# -- self-describing directories --------------------------------------------------------------
def test_prefix_directory_describes_itself(store: KVStore) -> None:
    pid, _ = _write(store, 40)
    d = store.prefix_dir(pid)
    assert read_manifest(d) == store.manifest(pid)
    m = store.manifest(pid)
    for i, a in enumerate(m.artifacts):
        assert (d / artifact_file_name(i)).read_bytes() == store.artifact(pid, a.name)
    record = json.loads((d / MANIFEST_FILE).read_text())
    record["manifest"] = record["manifest"].replace('"n_tokens": 40', '"n_tokens": 41')
    (d / MANIFEST_FILE).write_text(json.dumps(record))
    with pytest.raises(InvalidRecord, match="checksum"):
        read_manifest(d)


def test_removed_prefix_never_comes_back(tmp_path: Path) -> None:
    store = KVStore(_cfg(tmp_path / "home"))
    pid, _ = _write(store, 30)
    store.remove(pid)
    store.close()
    shutil.rmtree(tmp_path / "home" / "meta")
    again = KVStore(_cfg(tmp_path / "home"))
    assert again.list_prefixes() == []


# -- rebuilding lost metadata ------------------------------------------------------------------
def test_deleted_lmdb_is_rebuilt_from_disk(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = KVStore(_cfg(home))
    written = _fill(store)
    store.close()
    shutil.rmtree(home / "meta")
    store = KVStore(_cfg(home))
    assert sorted(m.prefix_id for m in store.list_prefixes()) == sorted(written)
    _assert_all_back(store, written)
    store.close()


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_pins_survive_metadata_loss(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A pinned prefix is pinned again after its metadata is rebuilt from disk; an unpinned one is not."""
    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    cfg = _cfg(tmp_path / "home", metadata_url=url)
    store = KVStore(cfg)
    ids = list(_fill(store, 3))
    store.pin(ids[0])
    store.pin(ids[1])
    assert store.unpin(ids[1])
    store.close()
    if url is None:
        shutil.rmtree(tmp_path / "home" / "meta")
    else:
        client = redis.Redis.from_url(url)
        client.flushall()
        client.close()
    store = KVStore(cfg)
    assert sorted(m.prefix_id for m in store.list_prefixes()) == sorted(ids)
    assert [store.usage_of(pid).pinned for pid in ids] == [True, False, False]  # type: ignore[union-attr]
    assert set(store.evict_to(0).evicted) == set(ids[1:]) and store.find(ids[0]) is not None
    assert store.unpin(ids[0]) and not store.unpin(ids[0])
    store.close()


@pytest.mark.parametrize("damage", ["truncated", "not_lmdb"])
def test_damaged_lmdb_is_moved_aside_and_rebuilt_without_a_crash(tmp_path: Path, damage: str) -> None:
    home = tmp_path / "home"
    store = KVStore(_cfg(home))
    written = _fill(store, 30)
    store.close()
    data = home / "meta" / "data.mdb"
    if damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    else:
        data.write_bytes(os.urandom(data.stat().st_size))
    # In a subprocess: mapping the truncated file would SIGBUS (exit -7) instead of raising.
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import _write
        from store.config import StoreConfig
        from store.kvstore import KVStore
        s = KVStore(StoreConfig(home={str(home)!r}, page_size=16, fsync=False))
        ids = [m.prefix_id for m in s.list_prefixes()]
        for pid in ids:
            s.read_layer(pid, 0, verify=True)
        _write(s, 33, seed=99)  # and it takes writes again
        print(json.dumps(ids))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert sorted(json.loads(r.stdout)) == sorted(written)
    assert "is damaged" in r.stderr
    assert len(list(home.glob("meta.damaged-*"))) == 1  # kept for inspection
    store = KVStore(_cfg(home))
    _assert_all_back(store, written | {_key(33, 99).prefix_id: _kv(33, seed=99)})
    store.close()


def test_metadata_loss_deletes_nothing_committed(tmp_path: Path) -> None:
    """Opening over empty metadata registers committed directories and deletes no directory, committed or not."""
    home = tmp_path / "home"
    store = KVStore(_cfg(home))
    written = _fill(store)
    pid_broken, pid_no_artifact = list(written)[:2]
    store.close()
    (home / "prefixes" / pid_broken / "layer_001.kv").write_bytes(b"short")  # cannot be registered
    (home / "prefixes" / pid_no_artifact / artifact_file_name(0)).unlink()  # nor can this (no other copy)
    junk = home / "prefixes" / ("f" * 32)
    junk.mkdir()
    before = sorted(p.name for p in (home / "prefixes").iterdir())
    shutil.rmtree(home / "meta")
    store = KVStore(_cfg(home))
    assert sorted(p.name for p in (home / "prefixes").iterdir()) == before
    assert sorted(m.prefix_id for m in store.list_prefixes()) == sorted(set(written) - {pid_broken, pid_no_artifact})
    report = store.recover()  # what the start found and left alone
    assert sorted(report.names(recovery.ORPHAN)) == sorted([pid_broken, pid_no_artifact, junk.name])
    assert not report.ok
    store.close()


def test_redis_flushed_then_store_restarted_lists_and_answers(redis_server: RedisServer,  # noqa: F811
                                                             tmp_path: Path, lm: LoadedModel) -> None:
    cfg = _cfg(tmp_path / "home", metadata_url=redis_server.url)
    store = KVStore(cfg)
    worker = Worker(store, lm, chunk_size=40, progress=False)
    doc = "The harbour master keeps the ledger. The tide turns at noon; the ferry leaves at four. " * 3
    pids = [worker.prefill(doc).prefix_id, worker.prefill(doc + " Postscript.").prefix_id]
    params = SamplingParams(max_new_tokens=8)
    answers = ["".join(worker.generate(pid, " The ferry leaves at", params)) for pid in pids]
    written = dict(_write(store, 30, seed=i) for i in range(2))
    store.close()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    store = KVStore(cfg)
    assert sorted(m.prefix_id for m in store.list_prefixes()) == sorted([*pids, *written])
    _assert_all_back(store, written)
    worker = Worker(store, lm, chunk_size=40, progress=False)
    assert ["".join(worker.generate(pid, " The ferry leaves at", params)) for pid in pids] == answers
    assert worker.prefill(doc).cached
    store.close()


# -- artifacts are files of the prefix directory only ------------------------------------------
@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_metadata_holds_no_artifact_bytes(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    store = KVStore(_cfg(tmp_path / "home", metadata_url=url))
    marker = os.urandom(64)
    key = _key(20, seed=5)
    with store.write_prefix(key, model_name="m", n_tokens=20) as w:
        for layer, (k, v) in enumerate(_kv(20, seed=5)):
            w.write_layer(layer, k, v)
        w.put_artifact("summary", marker * 8)
        w.commit()
    pid = key.prefix_id
    assert store.artifact(pid, "summary") == marker * 8
    crcs = store.page_crcs(pid).tobytes()
    if url is None:
        raw = b"".join(p.read_bytes() for p in (tmp_path / "home" / "meta").iterdir() if p.is_file())
        assert marker not in raw and crcs not in raw
    else:
        client = redis.Redis.from_url(url)
        values: list[bytes] = []
        for k in client.keys("*"):
            kind = client.type(k)
            values += ([client.get(k)] if kind == b"string" else list(client.hgetall(k).values()) if kind == b"hash"
                       else [])
        assert values and not any(marker in v or crcs in v for v in values)
        assert not [k for k in client.keys("*") if b"artifact" in k]
        client.close()
    store.close()


# -- check and repair --------------------------------------------------------------------------
def _damage_every_way(store: KVStore) -> dict[str, str]:
    """One instance of each problem ``check`` knows; the names it should report by kind."""
    ids = list(_fill(store, 9))
    d = store.prefixes_dir
    (d / ids[0] / "layer_000.kv").unlink()  # dangling: a page file missing
    shutil.rmtree(d / ids[1])  # dangling: the directory missing
    store._meta.delete(ids[2])  # unregistered
    with open(d / ids[3] / "layer_002.kv", "r+b") as f:  # corrupt: same size, other bytes
        f.seek(100)
        f.write(b"\xff\xfe")
    (d / ids[4] / MANIFEST_FILE).unlink()  # unrecorded: the metadata's manifest is written again
    (d / ids[5] / artifact_file_name(0)).unlink()  # dangling: an artifact file missing (its only copy)
    (d / ids[6] / artifact_file_name(0)).write_bytes(b"hellO")  # corrupt: an artifact fails its checksum
    store._meta.delete(ids[7])  # corrupt, and not registered: an artifact fails its checksum
    (d / ids[7] / artifact_file_name(0)).write_bytes(b"jello")
    m = store.manifest(ids[8])  # unrecorded: the directory holds another (valid) manifest
    disk_record.publish(d / ids[8], dataclasses.replace(m, created_at=m.created_at + 1), fsync=False)
    (d / ("e" * 32)).mkdir()  # orphan: no manifest
    (d / "lost+found").mkdir()  # orphan: not a prefix directory
    (d / f".tmp-{ids[0]}-1-deadbeef").mkdir()  # a writer that died
    return {recovery.DANGLING: sorted([ids[0], ids[1], ids[5]]), recovery.UNREGISTERED: [ids[2]],
            recovery.CORRUPT: sorted([ids[3], ids[6], ids[7]]), recovery.UNRECORDED: sorted([ids[4], ids[8]]),
            recovery.ORPHAN: sorted(["e" * 32, "lost+found"]), recovery.STALE_TEMP: [f".tmp-{ids[0]}-1-deadbeef"],
            "ids": ids}  # type: ignore[dict-item]


def test_check_reports_every_problem_and_repair_fixes_them(tmp_path: Path) -> None:
    store = KVStore(_cfg(tmp_path / "home"))
    expect = _damage_every_way(store)
    ids = expect.pop("ids")
    before = sorted(p.name for p in store.prefixes_dir.iterdir())
    report = store.check()
    assert not report.ok and not report.repaired
    assert {k: sorted(report.names(k)) for k in expect} == expect
    assert sorted(p.name for p in store.prefixes_dir.iterdir()) == before  # a plain check changes nothing
    quick = store.check(hash_pages=False)  # page files only stat'ed; artifacts still hashed
    assert sorted(quick.names(recovery.CORRUPT)) == sorted([ids[6], ids[7]])

    fixed = store.check(repair=True)
    assert fixed.ok and all(p.fixed for p in fixed.problems) and fixed.prefixes == 3
    after = store.check()
    assert after.ok and after.problems == () and after.prefixes == 3
    survivors = sorted([ids[2], ids[4], ids[8]])
    assert sorted(m.prefix_id for m in store.list_prefixes()) == survivors
    for pid in survivors:
        store.verify(pid)
        assert read_manifest(store.prefix_dir(pid)) == store.manifest(pid)
        assert (store.prefix_dir(pid) / artifact_file_name(0)).read_bytes() == b"hello"
    assert sorted(p.name for p in store.prefixes_dir.iterdir()) == survivors
    store.close()


def test_cli_store_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    store = KVStore(_cfg(home))
    pid, _ = _write(store, 30)
    damaged, _ = _write(store, 30, seed=1)
    (store.prefixes_dir / ("e" * 32)).mkdir()
    store._meta.delete(pid)
    with open(store.prefix_dir(damaged) / artifact_file_name(0), "r+b") as f:
        f.write(b"J")
    store.close()
    assert cli_main(["store", "check", "--home", str(home), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and {(p["kind"], p["name"]) for p in out["problems"]} == {
        (recovery.ORPHAN, "e" * 32), (recovery.UNREGISTERED, pid), (recovery.CORRUPT, damaged)}
    assert cli_main(["store", "check", "--home", str(home), "--repair"]) == 0
    text = capsys.readouterr().out
    assert f"fixed  {recovery.CORRUPT:<13} {damaged}  artifact 'extra'" in text and "fixed  unregistered" in text
    assert cli_main(["store", "check", "--home", str(home), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "prefixes": 1, "repaired": False, "busy": [],
                                                   "problems": []}


# -- bounds, quotas, capacity --------------------------------------------------------------------
def test_absurd_sizes_are_refused_before_anything_is_created(store: KVStore) -> None:
    for n in (MAX_TOKENS + 1, 1 << 62):
        with pytest.raises(InvalidInput, match="n_tokens"), store.write_prefix(_key(20), model_name="m", n_tokens=n):
            pass
    with pytest.raises(InvalidInput, match="model_name"), \
            store.write_prefix(_key(20), model_name="m" * 10_000, n_tokens=20):
        pass
    assert list(store.prefixes_dir.iterdir()) == []


def test_lease_holder_length_is_capped(store: KVStore) -> None:
    pid, _ = _write(store, 20)
    store.acquire_lease(pid, "h" * MAX_HOLDER_BYTES, 10)
    with pytest.raises(InvalidInput, match="holder"):
        store.acquire_lease(pid, "h" * (MAX_HOLDER_BYTES + 1), 10)
    with pytest.raises(InvalidInput, match="holder"), store.lease(pid, holder="é" * MAX_HOLDER_BYTES):
        pass
    assert len(store.leases(pid)) == 1


def test_tenant_quotas(tmp_path: Path) -> None:
    probe = KVStore(_cfg(tmp_path / "probe"))
    m = probe.manifest(_write(probe, 20)[0])
    size = m.kv_bytes + m.artifact_bytes
    store = KVStore(_cfg(tmp_path / "home", max_prefixes_per_tenant=2))
    _write(store, 20, seed=0, tenant="alice")
    _write(store, 20, seed=1, tenant="alice")
    with pytest.raises(QuotaExceeded, match="alice"):
        _write(store, 20, seed=2, tenant="alice")
    _write(store, 20, seed=3, tenant="bob")
    assert list(p.name.startswith(".tmp") for p in store.prefixes_dir.iterdir()).count(True) == 0
    by_bytes = KVStore(_cfg(tmp_path / "bytes", max_bytes_per_tenant=size + m.kv_bytes - 1))
    _write(by_bytes, 20, seed=0, tenant="alice")
    with pytest.raises(QuotaExceeded, match="quota"):
        _write(by_bytes, 20, seed=1, tenant="alice")  # its page files alone do not fit beside the first
    _write(by_bytes, 20, seed=1, tenant="bob")
    assert QuotaExceeded.grpc_code == "RESOURCE_EXHAUSTED" and QuotaExceeded.http_status == 429


def test_an_added_artifact_counts_bytes_not_prefixes(tmp_path: Path) -> None:
    """``add_artifact`` (a compressed cache built later) checks the byte quota, not the prefix count, and a
    refusal changes nothing."""
    probe = KVStore(_cfg(tmp_path / "probe"))
    m = probe.manifest(_write(probe, 20)[0])
    size = m.kv_bytes + m.artifact_bytes
    store = KVStore(_cfg(tmp_path / "home", max_prefixes_per_tenant=1, max_bytes_per_tenant=size + 10))
    pid = _write(store, 20, tenant="alice")[0]
    after = store.add_artifact(pid, "small", b"x" * 10)  # at its prefix quota, within its bytes
    files = sorted(p.name for p in store.prefix_dir(pid).iterdir())
    with pytest.raises(QuotaExceeded, match="alice"):
        store.add_artifact(pid, "big", b"y")
    assert store.manifest(pid) == after and after.artifact("big") is None
    assert sorted(p.name for p in store.prefix_dir(pid).iterdir()) == files


def test_capacity_eviction_runs_after_each_commit(tmp_path: Path) -> None:
    probe = KVStore(_cfg(tmp_path / "probe"))
    size = probe.usage_of(_write(probe, 20)[0]).bytes  # type: ignore[union-attr]
    store = KVStore(_cfg(tmp_path / "home", capacity_bytes=3 * size))
    ids = [_write(store, 20, seed=i)[0] for i in range(3)]
    assert store.usage() == 3 * size
    store.pin(ids[0])
    with store.lease(ids[1]):
        new, _ = _write(store, 20, seed=3)  # 4 * size: the least recently used evictable one goes
        assert not store.exists(ids[2]) and not store.prefix_dir(ids[2]).exists()
        assert all(store.exists(p) for p in (ids[0], ids[1], new)) and store.usage() == 3 * size
        store.unpin(ids[0])
        _write(store, 20, seed=4)
    assert not store.exists(ids[0]) and store.exists(ids[1]) and store.exists(new)
    with pytest.raises(QuotaExceeded, match="capacity"), \
            store.write_prefix(_key(16 * 40), model_name="m", n_tokens=16 * 40):
        pass
