"""Open the metadata backend a URL names (the only module that imports every backend)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from store.metadata import DEFAULT_LMDB_MAP_SIZE, DEFAULT_NAMESPACE, MetadataBackend

Opener = Callable[[str, Path, int, str], MetadataBackend]


def _open_lmdb(url: str, home: Path, map_size: int, namespace: str) -> MetadataBackend:
    from store.lmdb_metadata import LmdbMetadata

    path = urlsplit(url).path if url.startswith("lmdb://") else ""
    return LmdbMetadata(Path(path) if path else home / "meta", map_size)


def _open_redis(url: str, home: Path, map_size: int, namespace: str) -> MetadataBackend:
    from store.redis_metadata import RedisMetadata  # redis is needed only when configured

    return RedisMetadata(url, namespace=namespace)


BACKENDS: dict[str, Opener] = {"lmdb": _open_lmdb, "redis": _open_redis, "rediss": _open_redis,
                               "unix": _open_redis}
"""Metadata backends by URL scheme."""


def open_metadata(url: str | None, home: Path, *, lmdb_map_size: int = DEFAULT_LMDB_MAP_SIZE,
                  namespace: str = DEFAULT_NAMESPACE) -> MetadataBackend:
    """The backend a URL names: None/``lmdb`` (``home/meta``), ``lmdb:///path``, ``redis://host:port/db``,
    ``rediss://`` (TLS) or ``unix:///path/redis.sock``."""
    url = url or "lmdb"
    scheme = "lmdb" if url == "lmdb" else urlsplit(url).scheme
    opener = BACKENDS.get(scheme)
    if opener is None:
        raise ValueError(f"unknown metadata URL {url!r}: use lmdb, lmdb:///path, redis://host:port/db, "
                         "rediss://… or unix:///path")
    return opener(url, home, lmdb_map_size, namespace)
