"""One contract for every metadata backend (LMDB and a real redis-server): commits, listing,
deletes, leases, single-flight prefill locks, LRU byte accounting, eviction, restarts; and no artifact
bytes (a manifest lists artifacts; their bytes are files of the prefix directory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture

from store.artifacts import digest
from store.errors import InvalidInput, LockTimeout, PrefixInUse, PrefixNotFound
from store.layout import KVLayout
from store.manifest import ArtifactInfo, FileInfo, Manifest
from store.metadata import MetadataBackend, PrefixUsage
from store.metadata_factory import open_metadata
from store.prefix_key import PrefixKey

REPO = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(n_layers=1, n_kv_heads=1, head_dim=8, dtype="float32", page_size=16)


def make_manifest(seed: int, kv_bytes: int = 1000, artifacts: Mapping[str, bytes] | None = None) -> Manifest:
    """A manifest of ``kv_bytes`` page bytes plus (the entries of) ``artifacts``; its id depends on ``seed`` only."""
    key = PrefixKey(model_fingerprint="fp", tenant_salt="salt", token_hash=f"{seed:064x}", layout=LAYOUT)
    arts = tuple(ArtifactInfo(name=n, size=len(b), blake2b=digest(b)) for n, b in sorted((artifacts or {}).items()))
    return Manifest(prefix_id=key.prefix_id, key=key, model_name="m", n_tokens=16,
                    files=(FileInfo(name="layer_000.kv", size=kv_bytes, blake2b="0" * 32),), artifacts=arts,
                    created_at=time.time())


def commit(meta: MetadataBackend, seed: int, kv_bytes: int = 1000, artifacts: Mapping[str, bytes] | None = None,
           ) -> str:
    m = make_manifest(seed, kv_bytes, artifacts)
    meta.commit(m)
    return m.prefix_id


def commit_in_order(meta: MetadataBackend, seeds: range, kv_bytes: tuple[int, ...]) -> list[str]:
    """Commit one prefix per seed, a few ms apart, so their LRU order is the commit order."""
    ids = []
    for seed, size in zip(seeds, kv_bytes):
        ids.append(commit(meta, seed, size))
        time.sleep(0.01)
    return ids


def usage_of(meta: MetadataBackend, prefix_id: str) -> PrefixUsage:
    u = meta.prefix_usage(prefix_id)
    assert u is not None, f"{prefix_id} is not committed"
    return u


@dataclass
class Env:
    """One metadata store as a test sees it: more clients, restarts, a URL for subprocesses."""

    kind: str
    home: Path
    server: RedisServer | None = None
    opened: list[MetadataBackend] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url if self.server else "lmdb"

    def open(self) -> MetadataBackend:
        """A client. Redis: a new one each call. LMDB: one per process (LMDB forbids opening twice)."""
        if self.kind == "lmdb" and self.opened:
            return self.opened[0]
        meta = open_metadata(self.url, self.home)
        self.opened.append(meta)
        return meta

    def restart(self, hard: bool) -> MetadataBackend:
        """Close every client and restart the server (Redis: SIGKILL when ``hard``); a new client."""
        self.close()
        if self.server:
            self.server.restart(hard=hard)
        return self.open()

    def close(self) -> None:
        for meta in self.opened:
            meta.close()
        self.opened.clear()


@pytest.fixture(params=["lmdb", "redis"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    e = Env(request.param, tmp_path / "home", server)
    yield e
    e.close()


@pytest.fixture()
def meta(env: Env) -> MetadataBackend:
    return env.open()


class ExplodingManifest(Manifest):
    """A manifest whose byte count fails: a commit interrupted half way (LMDB: after its manifest was put)."""

    @property
    def artifact_bytes(self) -> int:
        raise RuntimeError("disk on fire")


def exploding(m: Manifest) -> ExplodingManifest:
    return ExplodingManifest(**{f.name: getattr(m, f.name) for f in fields(Manifest)})


# -- registry --------------------------------------------------------------------------------
def test_commit_is_visible_to_every_client(env: Env, meta: MetadataBackend) -> None:
    arts = {"phi": b"\x00\x01" * 100, "bounds": b"b"}
    m = make_manifest(1, 1000, arts)
    meta.commit(m)
    pid, other = m.prefix_id, env.open()
    assert other.manifest(pid) == m and other.manifest("0" * 32) is None
    assert [m.prefix_id for m in other.manifests()] == [pid]
    assert other.usage() == 1000 + 201  # artifacts are accounted (as files), not kept
    assert not hasattr(other, "artifact")


def test_interrupted_commit_leaves_nothing_and_keeps_the_old_version(meta: MetadataBackend) -> None:
    m = make_manifest(2)
    with pytest.raises(RuntimeError, match="on fire"):
        meta.commit(exploding(m))
    assert meta.manifest(m.prefix_id) is None
    assert meta.manifests() == [] and meta.usage() == 0 and meta.prefix_usage(m.prefix_id) is None
    old = make_manifest(2, 1000, {"a": b"old"})
    meta.commit(old)
    pid = old.prefix_id
    with pytest.raises(RuntimeError):
        meta.commit(exploding(make_manifest(2, 5000)))
    assert meta.manifest(pid) == old and meta.usage() == 1003 and usage_of(meta, pid).bytes == 1003


def test_manifest_is_never_visible_before_its_accounting(env: Env, meta: MetadataBackend) -> None:
    arts = {f"a{i}": bytes([i]) * 40_000 for i in range(4)}
    ids = [make_manifest(100 + i, artifacts=arts).prefix_id for i in range(30)]
    reader, seen, done = env.open(), [0], threading.Event()

    def read() -> None:
        while not done.is_set():
            for pid in ids:
                if reader.manifest(pid) is not None:
                    assert usage_of(reader, pid).bytes == 1000 + 160_000, pid
                    seen[0] += 1

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(30):
            commit(meta, 100 + i, artifacts=arts)
    finally:
        done.set()
        t.join()
    assert seen[0] > 0


def test_recommit_replaces_manifest_and_bytes(meta: MetadataBackend) -> None:
    pid = commit(meta, 3, 1000, {"a": b"aa", "b": b"bbb"})
    commit(meta, 3, 500, {"a": b"a"})
    assert [a.name for a in meta.manifest(pid).artifacts] == ["a"]  # type: ignore[union-attr]
    assert meta.usage() == 501 and usage_of(meta, pid).bytes == 501
    assert len(meta.manifests()) == 1


def test_delete_and_listing(meta: MetadataBackend) -> None:
    ids = [commit(meta, 10 + i, 100, {"x": b"12345"}) for i in range(5)]
    assert {m.prefix_id for m in meta.manifests()} == set(ids) and meta.usage() == 5 * 105
    meta.pin(ids[0])
    lease = meta.acquire_lease(ids[0], "w", 60)
    assert meta.delete(ids[0]) is True  # explicit delete proceeds even when pinned and leased
    assert meta.manifest(ids[0]) is None
    assert meta.prefix_usage(ids[0]) is None and meta.leases(ids[0]) == []
    assert meta.release_lease(lease) is False and meta.unpin(ids[0]) is False
    assert meta.delete(ids[0]) is False
    assert {m.prefix_id for m in meta.manifests()} == set(ids[1:]) and meta.usage() == 4 * 105
    assert sorted(meta.prefix_ids()) == sorted(ids[1:])


def test_delete_unless_leased_refuses_while_a_lease_lives(env: Env, meta: MetadataBackend) -> None:
    pid = commit(meta, 30, 100, {"x": b"12345"})
    meta.pin(pid)  # a pin does not stop a delete, only eviction
    lease = env.open().acquire_lease(pid, "gen", 60)
    with pytest.raises(PrefixInUse):
        meta.delete(pid, unless_leased=True)
    assert meta.manifest(pid) is not None and meta.usage() == 105
    assert [x.lease_id for x in meta.leases(pid)] == [lease]
    assert meta.release_lease(lease) is True
    assert meta.delete(pid, unless_leased=True) is True and meta.manifest(pid) is None
    with pytest.raises(PrefixNotFound):  # a lease after the delete finds nothing to hold
        meta.acquire_lease(pid, "gen", 60)
    assert meta.delete(pid, unless_leased=True) is False


# -- leases ----------------------------------------------------------------------------------
def test_lease_acquire_renew_release(env: Env, meta: MetadataBackend) -> None:
    with pytest.raises(PrefixNotFound):
        meta.acquire_lease("f" * 32, "w", 10)
    pid = commit(meta, 20)
    a, b = meta.acquire_lease(pid, "worker-a", 60), env.open().acquire_lease(pid, "worker-b", 60)
    assert a != b
    leases = {x.lease_id: x for x in meta.leases(pid)}
    assert set(leases) == {a, b} and leases[a].holder == "worker-a" and leases[a].prefix_id == pid
    assert time.time() + 50 < leases[a].expires_at < time.time() + 70
    assert usage_of(meta, pid).leases == 2
    assert meta.release_lease(a) is True and meta.release_lease(a) is False
    assert [x.lease_id for x in meta.leases(pid)] == [b]
    assert meta.renew_lease(b, 120) is True and meta.leases(pid)[0].expires_at > time.time() + 100
    assert meta.release_lease(b) is True and meta.leases(pid) == []
    assert meta.release_lease("garbage") is False and meta.renew_lease("x.y", 5) is False
    for bad in (0, -1, 10**6):
        with pytest.raises(InvalidInput):
            meta.acquire_lease(pid, "w", bad)


def test_leases_expire(meta: MetadataBackend) -> None:
    pid = commit(meta, 21)
    short, long = meta.acquire_lease(pid, "crashed", 0.2), meta.acquire_lease(pid, "alive", 0.6)
    assert meta.evict(pid) is False and meta.eviction_candidates(1) == []
    time.sleep(0.35)
    assert [x.lease_id for x in meta.leases(pid)] == [long]
    assert meta.renew_lease(short, 10) is False and meta.release_lease(short) is False
    assert meta.evict(pid) is False
    time.sleep(0.4)
    assert meta.leases(pid) == [] and meta.eviction_candidates(1) == [pid]
    assert meta.evict(pid) is True and meta.manifest(pid) is None


# -- single flight ---------------------------------------------------------------------------
def test_single_flight_across_threads(env: Env) -> None:
    m = make_manifest(30)
    work, holders, max_holders, lock = [], [0], [0], threading.Lock()
    clients = [env.open() for _ in range(6)]
    barrier = threading.Barrier(len(clients))

    def prefill(meta: MetadataBackend) -> None:
        barrier.wait()
        with meta.prefill_lock(m.prefix_id, ttl_s=5):
            with lock:
                holders[0] += 1
                max_holders[0] = max(max_holders[0], holders[0])
            if meta.manifest(m.prefix_id) is None:
                time.sleep(0.2)  # the forward pass
                work.append(1)
                meta.commit(m)
            with lock:
                holders[0] -= 1

    threads = [threading.Thread(target=prefill, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(work) == 1 and max_holders[0] == 1


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from store.manifest import Manifest
    from store.metadata_factory import open_metadata
    mode, url, home, manifest_path, go = sys.argv[1:6]
    m = Manifest.from_json(Path(manifest_path).read_text())
    meta = open_metadata(url, Path(home))
    if mode == "hold":
        with meta.prefill_lock(m.prefix_id, ttl_s=1.0):
            print("held", flush=True)
            time.sleep(60)
    print("ready", flush=True)
    while not Path(go).exists():
        time.sleep(0.005)
    with meta.prefill_lock(m.prefix_id, ttl_s=5):
        if meta.manifest(m.prefix_id) is None:
            time.sleep(0.3)
            meta.commit(m)
            print("did the work", flush=True)
""")


def _child(env: Env, mode: str, tmp_path: Path, m: Manifest) -> subprocess.Popen[str]:
    (tmp_path / "m.json").write_text(m.to_json())
    args = [sys.executable, "-c", CHILD, mode, env.url, str(env.home), str(tmp_path / "m.json"), str(tmp_path / "go")]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_single_flight_across_processes(env: Env, tmp_path: Path) -> None:
    m = make_manifest(31)
    env.open()  # LMDB: create the environment before the children race to
    children = [_child(env, "prefill", tmp_path, m) for _ in range(3)]
    for c in children:
        assert c.stdout is not None and c.stdout.readline().strip() == "ready"
    (tmp_path / "go").touch()  # all three are past their imports: they contend for real
    outs = [c.communicate(timeout=60) for c in children]
    assert all(c.returncode == 0 for c in children), [err for _, err in outs]
    assert sum(out.count("did the work") for out, _ in outs) == 1
    assert env.open().manifest(m.prefix_id) == m


def test_prefill_lock_times_out_then_frees_when_its_holder_crashes(env: Env, meta: MetadataBackend,
                                                                   tmp_path: Path) -> None:
    m = make_manifest(32)
    child = _child(env, "hold", tmp_path, m)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held", child.stderr
        t0 = time.monotonic()
        with pytest.raises(LockTimeout), meta.prefill_lock(m.prefix_id, wait_s=0.3):
            pass
        assert time.monotonic() - t0 < 2.0
    finally:
        child.kill()
        child.communicate()
    t0 = time.monotonic()
    with meta.prefill_lock(m.prefix_id, ttl_s=1, wait_s=10):  # Redis: its TTL (1 s) runs out; flock: at once
        assert time.monotonic() - t0 < 5.0


def test_prefill_lock_is_renewed_while_held(env: Env, meta: MetadataBackend) -> None:
    pid, entered, release = make_manifest(33).prefix_id, threading.Event(), threading.Event()

    def hold() -> None:
        with meta.prefill_lock(pid, ttl_s=0.6):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(10)
        time.sleep(1.5)  # well past the TTL: only renewal keeps it
        with pytest.raises(LockTimeout), env.open().prefill_lock(pid, wait_s=0):
            pass
    finally:
        release.set()
        t.join()
    with env.open().prefill_lock(pid, wait_s=0):
        pass


# -- LRU, pins, eviction ---------------------------------------------------------------------
def test_lru_order_and_byte_accounting(meta: MetadataBackend) -> None:
    a, b, c = commit_in_order(meta, range(40, 43), (100, 200, 300))
    assert meta.usage() == 600 and usage_of(meta, b).bytes == 200
    before = usage_of(meta, a).last_used
    time.sleep(0.01)
    assert meta.touch(a) is True and usage_of(meta, a).last_used > before
    assert meta.eviction_candidates(0) == []
    assert meta.eviction_candidates(1) == [b]
    assert meta.eviction_candidates(200) == [b]
    assert meta.eviction_candidates(201) == [b, c]
    assert meta.eviction_candidates(10**12) == [b, c, a]
    assert meta.touch("0" * 32) is False and meta.prefix_usage("0" * 32) is None and meta.usage() == 600
    assert meta.evict(b) is True and meta.usage() == 400 and meta.eviction_candidates(10**12) == [c, a]


def test_eviction_skips_pinned_and_leased(env: Env, meta: MetadataBackend) -> None:
    a, b, c = commit_in_order(meta, range(50, 53), (100, 100, 100))
    meta.pin(a)
    lease = env.open().acquire_lease(b, "gen", 60)
    assert usage_of(meta, a).pinned and not usage_of(meta, b).pinned
    assert meta.eviction_candidates(10**12) == [c]
    assert meta.evict(a) is False and meta.evict(b) is False and meta.evict(c) is True
    assert meta.usage() == 200 and {m.prefix_id for m in meta.manifests()} == {a, b}
    assert meta.unpin(a) is True and meta.unpin(a) is False
    assert meta.eviction_candidates(10**12) == [a]
    assert meta.release_lease(lease) is True
    assert meta.eviction_candidates(10**12) == [a, b]
    with pytest.raises(PrefixNotFound):
        meta.pin(c)
    assert meta.evict(c) is False


# -- restarts --------------------------------------------------------------------------------
@pytest.mark.parametrize("hard", [False, True], ids=["clean", "killed"])
def test_committed_state_survives_a_restart(env: Env, meta: MetadataBackend, hard: bool) -> None:
    a = commit(meta, 60, 100, {"phi": b"p" * 1000})
    time.sleep(0.01)
    mb = make_manifest(61, 200, {"phi": b"q"})
    meta.commit(mb)
    b = mb.prefix_id
    meta.pin(b)
    lease = meta.acquire_lease(a, "w", 60)
    usage = meta.usage()
    after = env.restart(hard=hard)
    assert {m.prefix_id for m in after.manifests()} == {a, b}
    assert usage_of(after, a).bytes == 1100 and after.manifest(b) == mb
    assert after.usage() == usage and usage_of(after, b).pinned
    assert [x.lease_id for x in after.leases(a)] == [lease] and after.eviction_candidates(10**12) == []
    assert after.release_lease(lease) is True and after.eviction_candidates(1) == [a]


# -- LMDB: what is synced to disk ------------------------------------------------------------------
class _CountingEnv:
    """An LMDB environment that counts its syncs (the rest is the real environment's)."""

    def __init__(self, env: object) -> None:
        self.env, self.syncs = env, 0

    def sync(self, force: bool = False) -> None:
        self.syncs += 1
        self.env.sync(force)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.env, name)


def test_lmdb_syncs_registry_changes_but_not_leases_or_last_used(tmp_path: Path) -> None:
    """A generation takes a lease, touches and releases it: no fsync each (they were most of a short request's
    time outside its steps); a commit, a pin and a delete are on disk when they return."""
    from store.lmdb_metadata import LmdbMetadata

    meta = open_metadata("lmdb", tmp_path)
    assert isinstance(meta, LmdbMetadata)
    counting = _CountingEnv(meta._env)
    meta._env = counting  # type: ignore[assignment]
    pid = commit(meta, 95)
    assert counting.syncs == 1
    lease = meta.acquire_lease(pid, "w", 30)
    assert meta.touch(pid) and meta.renew_lease(lease, 30) and meta.release_lease(lease)
    assert counting.syncs == 1, "leases and last-used times are not synced"
    meta.pin(pid)
    meta.unpin(pid)
    assert meta.delete(pid)
    assert counting.syncs == 4
    meta._env = counting.env  # type: ignore[assignment]
    meta.close()


# -- metadata written by an older kvstash (artifact bytes kept beside the manifests) -------------
def test_lmdb_drops_legacy_artifact_copies_at_open(tmp_path: Path) -> None:
    import lmdb

    from store.lmdb_metadata import LEGACY_ARTIFACTS_DB

    meta = open_metadata("lmdb", tmp_path)
    pid = commit(meta, 90, 100, {"phi": b"p" * 5000})
    meta.close()
    env = lmdb.open(str(tmp_path / "meta"), max_dbs=8, subdir=True)  # what an older version left
    with env.begin(write=True) as txn:
        old = env.open_db(LEGACY_ARTIFACTS_DB, txn=txn)
        txn.put(f"{pid}/phi".encode(), b"p" * 5000, db=old)
    env.close()
    meta = open_metadata("lmdb", tmp_path)  # starts, and drops them
    assert meta.manifest(pid) is not None and usage_of(meta, pid).bytes == 5100
    meta.close()
    env = lmdb.open(str(tmp_path / "meta"), max_dbs=8, subdir=True)
    with env.begin() as txn:
        assert txn.get(LEGACY_ARTIFACTS_DB) is None
        assert sorted(bytes(k) for k in txn.cursor().iternext(values=False)) == [b"leases", b"lru", b"manifests",
                                                                                 b"pins"]
    env.close()


def test_redis_deletes_legacy_artifact_copies_with_their_prefix(redis_server: RedisServer,  # noqa: F811
                                                               tmp_path: Path) -> None:
    import redis

    from store.redis_metadata import LEGACY_ARTIFACTS

    raw = redis.Redis.from_url(redis_server.url)
    meta = open_metadata(redis_server.url, tmp_path)
    a, b = commit(meta, 91, 100, {"phi": b"p"}), commit(meta, 92, 100, {"phi": b"p"})
    for pid in (a, b):  # what an older version left
        raw.hset(f"kvstash:{LEGACY_ARTIFACTS}:{pid}", "phi", b"p")
    meta = open_metadata(redis_server.url, tmp_path)  # starts with them there
    assert meta.manifest(a) is not None and meta.usage() == 202
    commit(meta, 91, 100, {"phi": b"p"})  # a commit drops its prefix's copies
    assert not raw.exists(f"kvstash:{LEGACY_ARTIFACTS}:{a}") and raw.exists(f"kvstash:{LEGACY_ARTIFACTS}:{b}")
    assert meta.delete(b)  # and so does a delete (or an eviction)
    assert not [k for k in raw.keys("*") if b"artifacts" in k]
    for c in (meta, raw):
        c.close()


# -- Redis specifics -------------------------------------------------------------------------
def test_redis_client_reconnects_after_a_restart(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    meta = open_metadata(redis_server.url, tmp_path)
    pid = commit(meta, 70)
    redis_server.restart(hard=True)  # also empties the server's script cache
    assert meta.manifest(pid) is not None
    assert meta.release_lease(meta.acquire_lease(pid, "w", 5)) is True
    meta.close()


def test_redis_down_is_store_unavailable(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    from store.errors import StoreUnavailable

    meta = open_metadata(redis_server.url, tmp_path)
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="Redis"):
        meta.manifest("0" * 32)
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        open_metadata(redis_server.url, tmp_path)
    assert time.monotonic() - t0 < 10
    meta.close()


def test_redis_namespaces_are_isolated(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    import redis

    one = open_metadata(redis_server.url, tmp_path, namespace="one:")
    two = open_metadata(redis_server.url, tmp_path, namespace="two:")
    pid = commit(one, 80)
    one.acquire_lease(pid, "w", 60)
    assert two.manifest(pid) is None and two.manifests() == [] and two.usage() == 0
    raw = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert raw.keys("*") and all(str(k).startswith("one:") for k in raw.keys("*"))
    for c in (one, two, raw):
        c.close()


def test_open_metadata_by_url(tmp_path: Path) -> None:
    from store.lmdb_metadata import LmdbMetadata

    for url in (None, "lmdb", f"lmdb://{tmp_path}/elsewhere"):
        meta = open_metadata(url, tmp_path / "home")
        assert isinstance(meta, LmdbMetadata)
        meta.close()
    assert (tmp_path / "home" / "meta" / "data.mdb").exists() and (tmp_path / "elsewhere" / "data.mdb").exists()
    with pytest.raises(ValueError, match="unknown metadata URL"):
        open_metadata("ftp://x", tmp_path)


def test_missing_redis_server_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch,
                                                        request: pytest.FixtureRequest) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y redis-server"):
        request.getfixturevalue("redis_server")
