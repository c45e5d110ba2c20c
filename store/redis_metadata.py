"""Redis metadata backend: registry, leases, single-flight locks and LRU shared by every host.

Keys, all under the namespace ``ns`` (default ``kvstash:``)::

    {ns}manifest:{pid}   string  manifest JSON: the commit point
    {ns}prefixes         zset    pid -> last used (unix s): the registry and the LRU order
    {ns}bytes            hash    pid -> accounted bytes
    {ns}usage            string  total accounted bytes
    {ns}pinned           set     pinned pids
    {ns}leases:{pid}     zset    lease id -> expiry (Redis server clock, ms); expires with its last lease
    {ns}holders:{pid}    hash    lease id -> holder
    {ns}lock:{pid}       string  prefill lock token (PX ttl, renewed while held)

No artifact bytes: they are files of the prefix directory only. A server written by an older kvstash may
still hold ``{ns}artifacts:{pid}`` hashes: nothing reads them, and a commit or delete of that prefix
deletes its one (``LEGACY_ARTIFACTS``); keys are never scanned for the rest.

A commit is one MULTI/EXEC (manifest and accounting); conditional changes
(lease on a committed prefix, evict unless pinned or leased) are Lua scripts, so they are
atomic with respect to each other. Lease expiry uses the server's clock, never the hosts'.
Durability is the server's: run it with ``appendonly yes`` (``appendfsync always`` for
the same guarantee as LMDB).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.client import Pipeline
from redis.exceptions import LockError, RedisError
from redis.lock import Lock
from redis.retry import Retry

from store.errors import LockTimeout, PrefixInUse, PrefixNotFound, StoreUnavailable
from store.locks import Renewer
from store.manifest import Manifest
from store.metadata import (
    DEFAULT_NAMESPACE,
    Lease,
    MetadataBackend,
    PrefixUsage,
    check_ttl,
    lease_prefix,
    new_lease_id,
    prefix_bytes,
)

log = logging.getLogger(__name__)

_BATCH = 256
LEGACY_ARTIFACTS = "artifacts"
"""Key kind of the artifact hashes older versions kept per prefix (deleted with the prefix's next commit or delete)."""
_NOW = ("local t = redis.call('TIME') "
        "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) ")
# Keep the leases/holders keys alive exactly as long as their latest lease.
_EXPIRE_WITH_LAST = ("local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2] "
                     "if last then redis.call('PEXPIREAT', KEYS[1], last) redis.call('PEXPIREAT', KEYS[2], last) end ")

# KEYS: leases, holders, manifest; ARGV: lease id, ttl ms, holder -> expiry ms, or -1 without a manifest
_ACQUIRE = _NOW + """
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(dead))
end
local exp = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], exp, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
""" + _EXPIRE_WITH_LAST + "return exp"

# KEYS: leases, holders; ARGV: lease id, ttl ms (0: release) -> 1 when the lease was live
_RENEW_OR_RELEASE = _NOW + """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
local live = s and tonumber(s) > now
if live and tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
""" + _EXPIRE_WITH_LAST + """
elseif s then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
if live then return 1 end
return 0"""

# KEYS: leases, holders, manifest, legacy artifacts, prefixes, bytes, usage, pinned; ARGV: pid, mode
# (1: delete whatever holds it; 0: evict: not pinned or leased, else 0; 2: not leased, else -1)
_DELETE = _NOW + """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if ARGV[2] == '0' and redis.call('SISMEMBER', KEYS[8], ARGV[1]) == 1 then return 0 end
if ARGV[2] ~= '1' and redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf') > 0 then
  if ARGV[2] == '2' then return -1 end
  return 0
end
local size = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('SREM', KEYS[8], ARGV[1])
redis.call('DECRBY', KEYS[7], size)
return 1"""

# KEYS: manifest, pinned; ARGV: pid -> 1 when pinned, 0 without a manifest
_PIN = "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end redis.call('SADD', KEYS[2], ARGV[1]) return 1"

P = ParamSpec("P")
R = TypeVar("R")


def _unavailable(e: RedisError) -> StoreUnavailable:
    return StoreUnavailable(f"Redis metadata store failed: {type(e).__name__}: {e}")


def _redis_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn Redis client errors (connection refused, timeouts, OOM) into StoreUnavailable."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RedisError as e:
            raise _unavailable(e) from e

    return wrapper


def _without_password(url: str) -> str:
    """``url`` with any password masked (metadata URLs carry Redis's password; messages and logs must not)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}"
    return urlunsplit(parts._replace(netloc=netloc))


def _str(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class RedisMetadata(MetadataBackend):
    """Metadata on a real Redis server (redis-py), shared by every store and worker process."""

    def __init__(self, url: str, *, namespace: str = DEFAULT_NAMESPACE, client: redis.Redis | None = None) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        self._ns = namespace
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=4)
        self._r: Any = client or redis.Redis.from_url(
            url, socket_connect_timeout=2.0, socket_timeout=10.0, retry=retry, health_check_interval=30)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew_or_release = self._r.register_script(_RENEW_OR_RELEASE)
        self._delete = self._r.register_script(_DELETE)
        self._pin = self._r.register_script(_PIN)
        self._prefixes, self._bytes = self._k("prefixes"), self._k("bytes")
        self._usage, self._pinned = self._k("usage"), self._k("pinned")
        try:
            self._r.ping()
        except RedisError as e:
            raise StoreUnavailable(f"cannot reach Redis metadata store at {_without_password(url)}: {e}") from e

    def _k(self, kind: str, prefix_id: str = "") -> str:
        return f"{self._ns}{kind}:{prefix_id}" if prefix_id else f"{self._ns}{kind}"

    def _lease_keys(self, prefix_id: str) -> list[str]:
        return [self._k("leases", prefix_id), self._k("holders", prefix_id)]

    def _now_ms(self) -> int:
        sec, usec = self._r.time()
        return int(sec) * 1000 + int(usec) // 1000

    # -- registry ------------------------------------------------------------------------
    @_redis_errors
    def commit(self, manifest: Manifest) -> None:
        """One MULTI/EXEC: the manifest, LRU entry and byte count (and an older version's artifact copies gone)."""
        pid, size = manifest.prefix_id, prefix_bytes(manifest)
        mkey = self._k("manifest", pid)

        def tx(pipe: Pipeline) -> None:
            old = int(pipe.hget(self._bytes, pid) or 0)  # changes only together with mkey
            pipe.multi()
            pipe.delete(self._k(LEGACY_ARTIFACTS, pid))
            pipe.set(mkey, manifest.to_json())
            pipe.zadd(self._prefixes, {pid: time.time()})
            pipe.hset(self._bytes, pid, size)
            pipe.incrby(self._usage, size - old)

        self._r.transaction(tx, mkey)

    @_redis_errors
    def manifest(self, prefix_id: str) -> Manifest | None:
        """The committed manifest, or None."""
        raw = self._r.get(self._k("manifest", prefix_id))
        return None if raw is None else Manifest.from_json(raw)

    @_redis_errors
    def manifests(self) -> list[Manifest]:
        """Every committed manifest (listed from the registry, never by scanning keys)."""
        ids = [_str(x) for x in self._r.zrange(self._prefixes, 0, -1)]
        out = []
        for i in range(0, len(ids), _BATCH):
            raws = self._r.mget([self._k("manifest", pid) for pid in ids[i:i + _BATCH]])
            out += [Manifest.from_json(raw) for raw in raws if raw is not None]
        return out

    @_redis_errors
    def prefix_ids(self) -> list[str]:
        """The ids in the registry whose manifest exists (one EXISTS each, pipelined in batches)."""
        ids = [_str(x) for x in self._r.zrange(self._prefixes, 0, -1)]
        out = []
        for i in range(0, len(ids), _BATCH):
            pipe = self._r.pipeline(transaction=False)
            for pid in ids[i:i + _BATCH]:
                pipe.exists(self._k("manifest", pid))
            out += [pid for pid, n in zip(ids[i:i + _BATCH], pipe.execute()) if n]
        return out

    def _delete_keys(self, prefix_id: str) -> list[str]:
        return [*self._lease_keys(prefix_id), self._k("manifest", prefix_id), self._k(LEGACY_ARTIFACTS, prefix_id),
                self._prefixes, self._bytes, self._usage, self._pinned]

    @_redis_errors
    def delete(self, prefix_id: str, *, unless_leased: bool = False) -> bool:
        """Remove everything of a prefix atomically: leased or not, or (``unless_leased``) ``PrefixInUse``
        when it has a live lease."""
        done = int(self._delete(keys=self._delete_keys(prefix_id), args=[prefix_id, 2 if unless_leased else 1]))
        if done < 0:
            raise PrefixInUse(f"prefix {prefix_id} is in use: it has live leases")
        return bool(done)

    # -- leases --------------------------------------------------------------------------
    @_redis_errors
    def acquire_lease(self, prefix_id: str, holder: str, ttl_s: float) -> str:
        """Lease a committed prefix, atomically with checking that it is committed."""
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        lease_id = new_lease_id(prefix_id)
        keys = [*self._lease_keys(prefix_id), self._k("manifest", prefix_id)]
        if int(self._acquire(keys=keys, args=[lease_id, ttl_ms, holder])) < 0:
            raise PrefixNotFound(f"no prefix {prefix_id!r}")
        return lease_id

    def _renew_or_release_lease(self, lease_id: str, ttl_ms: int) -> bool:
        pid = lease_prefix(lease_id)
        if pid is None:
            return False
        return bool(self._renew_or_release(keys=self._lease_keys(pid), args=[lease_id, ttl_ms]))

    @_redis_errors
    def renew_lease(self, lease_id: str, ttl_s: float) -> bool:
        """Extend a live lease; a lapsed one is dropped and stays lapsed."""
        return self._renew_or_release_lease(lease_id, max(1, round(check_ttl(ttl_s) * 1000)))

    @_redis_errors
    def release_lease(self, lease_id: str) -> bool:
        """End a lease; False when it had already lapsed or is unknown."""
        return self._renew_or_release_lease(lease_id, 0)

    @_redis_errors
    def leases(self, prefix_id: str) -> list[Lease]:
        """The live leases of a prefix."""
        lkey, hkey = self._lease_keys(prefix_id)
        live = self._r.zrangebyscore(lkey, f"({self._now_ms()}", "+inf", withscores=True)
        if not live:
            return []
        holders = self._r.hmget(hkey, [m for m, _ in live])
        return [Lease(lease_id=_str(m), prefix_id=prefix_id, holder=_str(h or b""), expires_at=s / 1000)
                for (m, s), h in zip(live, holders)]

    @contextlib.contextmanager
    def prefill_lock(self, prefix_id: str, ttl_s: float = 30.0, *, wait_s: float | None = None) -> Iterator[None]:
        """A Redis lock (SET NX PX) renewed every ttl/3 while held: a crashed holder frees it after ``ttl_s``."""
        ttl_s = check_ttl(ttl_s)
        lock = Lock(self._r, self._k("lock", prefix_id), timeout=ttl_s, sleep=0.05, blocking_timeout=wait_s,
                    thread_local=False)
        try:
            taken = lock.acquire()
        except RedisError as e:
            raise _unavailable(e) from e
        if not taken:
            raise LockTimeout(f"prefill of {prefix_id} is in progress elsewhere (waited {wait_s} s)")
        try:
            with Renewer(functools.partial(self._renew_lock, lock), ttl_s / 3, f"prefill lock of {prefix_id}"):
                yield
        finally:
            try:
                lock.release()
            except LockError:
                log.warning("prefill lock of %s had expired before release", prefix_id)
            except RedisError as e:  # it expires on its own after ttl_s
                log.warning("could not release prefill lock of %s: %s", prefix_id, e)

    @staticmethod
    def _renew_lock(lock: Lock) -> bool:
        try:
            lock.reacquire()
        except LockError:
            return False
        except RedisError as e:  # transient: keep trying while the TTL lasts
            log.warning("renewing %s failed: %s", lock.name, e)
        return True

    # -- LRU, pins, eviction -------------------------------------------------------------
    @_redis_errors
    def touch(self, prefix_id: str) -> bool:
        """Mark a prefix as just used (ZADD XX: never resurrects a deleted one)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(self._prefixes, {prefix_id: time.time()}, xx=True)
        pipe.zscore(self._prefixes, prefix_id)
        return pipe.execute()[1] is not None

    @_redis_errors
    def usage(self) -> int:
        """Total bytes of every committed prefix."""
        return int(self._r.get(self._usage) or 0)

    @_redis_errors
    def prefix_usage(self, prefix_id: str) -> PrefixUsage | None:
        """Accounting of one prefix."""
        now = self._now_ms()
        pipe = self._r.pipeline(transaction=False)
        pipe.zscore(self._prefixes, prefix_id)
        pipe.hget(self._bytes, prefix_id)
        pipe.sismember(self._pinned, prefix_id)
        pipe.zcount(self._k("leases", prefix_id), f"({now}", "+inf")
        last_used, size, pinned, leases = pipe.execute()
        if last_used is None:
            return None
        return PrefixUsage(prefix_id=prefix_id, bytes=int(size or 0), last_used=float(last_used),
                           pinned=bool(pinned), leases=int(leases))

    @_redis_errors
    def eviction_candidates(self, bytes_needed: int) -> list[str]:
        """Walk the LRU zset in batches, skipping pinned and leased prefixes, until enough bytes."""
        out: list[str] = []
        got, start, now = 0, 0, self._now_ms()
        pinned = {_str(x) for x in self._r.smembers(self._pinned)}
        while got < bytes_needed:
            ids = [_str(x) for x in self._r.zrange(self._prefixes, start, start + _BATCH - 1)]
            if not ids:
                break
            start += len(ids)
            pipe = self._r.pipeline(transaction=False)
            pipe.hmget(self._bytes, ids)
            for pid in ids:
                pipe.zcount(self._k("leases", pid), f"({now}", "+inf")
            sizes, *leased = pipe.execute()
            for pid, size, n in zip(ids, sizes, leased):
                if got >= bytes_needed:
                    break
                if pid not in pinned and not n:
                    out.append(pid)
                    got += int(size or 0)
        return out

    @_redis_errors
    def evict(self, prefix_id: str) -> bool:
        """Delete the prefix unless pinned or leased, in one script (atomic with leases and pins)."""
        return bool(self._delete(keys=self._delete_keys(prefix_id), args=[prefix_id, 0]))

    @_redis_errors
    def pin(self, prefix_id: str) -> None:
        """Exempt a committed prefix from eviction."""
        if not self._pin(keys=[self._k("manifest", prefix_id), self._pinned], args=[prefix_id]):
            raise PrefixNotFound(f"no prefix {prefix_id!r}")

    @_redis_errors
    def unpin(self, prefix_id: str) -> bool:
        """Make a prefix evictable again."""
        return bool(self._r.srem(self._pinned, prefix_id))

    def close(self) -> None:
        """Close the connection pool."""
        self._r.close()
