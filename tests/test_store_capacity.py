"""KVStore over either metadata backend: the backend chosen by URL, leases during use,
``evict_to`` removing least recently used prefixes (metadata and page files) but never
pinned or leased ones."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from test_store import _write

from store.config import StoreConfig
from store.errors import InvalidInput, PrefixNotFound
from store.kvstore import KVStore
from store.lmdb_metadata import LmdbMetadata
from store.redis_metadata import RedisMetadata


@pytest.fixture(params=["lmdb", "redis"])
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> StoreConfig:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    return StoreConfig(home=tmp_path / "home", metadata_url=url, fsync=False)


@pytest.fixture()
def store(store_config: StoreConfig) -> Iterator[KVStore]:
    s = KVStore(store_config)
    yield s
    s.close()


def test_backend_is_chosen_by_url(store: KVStore, store_config: StoreConfig) -> None:
    expected = RedisMetadata if store_config.metadata_url else LmdbMetadata
    assert isinstance(store._meta, expected)  # white box: which backend the URL opened


def test_evict_to_skips_pinned_and_leased_and_removes_files(store: KVStore) -> None:
    ids = []
    for seed in range(4):
        ids.append(_write(store, 40, seed=seed)[0])
        time.sleep(0.01)
    usage = store.usage_of(ids[0])
    assert usage is not None
    size = usage.bytes
    assert store.usage() == 4 * size
    store.pin(ids[0])
    with store.lease(ids[1]) as lease:
        assert [x.lease_id for x in store.leases(ids[1])] == [lease.lease_id]
        result = store.evict_to(0)
    assert result.evicted == (ids[2], ids[3]) and result.freed_bytes == 2 * size
    assert result.usage_bytes == 2 * size and result.satisfied is False
    for pid in ids[2:]:
        assert not store.exists(pid) and not store.prefix_dir(pid).exists()
    for pid in ids[:2]:
        store.verify(pid)
    assert store.leases(ids[1]) == []  # released on exit
    result = store.evict_to(size)
    assert result.evicted == (ids[1],) and result.satisfied and result.usage_bytes == size
    assert store.evict_to(10**12).evicted == () and store.evict_to(10**12).satisfied
    with pytest.raises(InvalidInput):
        store.evict_to(-1)


def test_lease_marks_use_and_keeps_itself_alive(store: KVStore) -> None:
    old, _ = _write(store, 20, seed=0)
    time.sleep(0.01)
    new, _ = _write(store, 20, seed=1)
    with store.lease(old, holder="gen-1", ttl_s=1.0) as h:
        assert store._meta.eviction_candidates(1) == [new]  # ``old`` was just used and is leased (white box)
        first = h.lease_id
        time.sleep(0.4)
        h.keepalive()  # due (> ttl/3): renewed in place
        assert h.lease_id == first and store.leases(old)[0].expires_at > time.time() + 0.8
        time.sleep(1.1)
        assert store.leases(old) == []  # lapsed: nobody kept it alive
        h.keepalive()  # re-acquired
        assert h.lease_id != first and [x.holder for x in store.leases(old)] == ["gen-1"]
    assert store.leases(old) == []
    with pytest.raises(PrefixNotFound), store.lease("0" * 32):
        pass


def test_two_stores_share_redis_metadata(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    cfg = StoreConfig(home=tmp_path / "shared", metadata_url=redis_server.url, fsync=False)
    a, b = KVStore(cfg), KVStore(cfg)
    pid, kv = _write(a, 30)
    k, _ = b.read_layer(pid, 0, verify=True)
    assert k.equal(kv[0][0]) and [m.prefix_id for m in b.list_prefixes()] == [pid]
    b.remove(pid)
    assert not a.exists(pid)
    a.close()
    b.close()


def test_concurrent_writes_of_one_tenant_cannot_together_exceed_its_quota(store_config: StoreConfig) -> None:
    import dataclasses

    from test_store import _key, _kv

    from store.errors import QuotaExceeded

    s = KVStore(dataclasses.replace(store_config, max_prefixes_per_tenant=1))
    try:
        writers = []
        for seed in (1, 2):  # both pass the early check: nothing is stored yet
            key, kv = _key(40, seed, s.config.page_size), _kv(40, seed=seed)
            cm = s.write_prefix(key, model_name="m", n_tokens=40, tenant="t")
            w = cm.__enter__()
            for layer, (k, v) in enumerate(kv):
                w.write_layer(layer, k, v)
            writers.append((key.prefix_id, cm, w))
        (first, cm1, w1), (second, cm2, w2) = writers
        w1.commit()
        cm1.__exit__(None, None, None)
        with pytest.raises(QuotaExceeded, match="quota is 1"):
            w2.commit()
        cm2.__exit__(None, None, None)
        assert [m.prefix_id for m in s.list_prefixes("t")] == [first]
        assert not s.prefix_dir(second).exists()
        assert not any(p.name.startswith(".tmp-") for p in s.prefixes_dir.iterdir())  # nothing half-written left
    finally:
        s.close()
