"""Configuration of the embedded store."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = Path("~/.cache/kvstash")


def default_home() -> Path:
    """The data directory: ``$KVSTASH_HOME`` or ``~/.cache/kvstash``."""
    return Path(os.environ.get("KVSTASH_HOME", str(DEFAULT_HOME))).expanduser()


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where and how the embedded store keeps prefixes."""

    home: Path = field(default_factory=default_home)
    """Data directory: page files under ``prefixes/``, LMDB under ``meta/``."""
    page_size: int = 16
    """Tokens per page (per layer and KV head); 16 x head_dim 128 x bf16 x K,V = 8 KiB."""
    lmdb_map_size: int = 1 << 36
    """Upper bound of the LMDB file (address space only; the file grows as needed)."""
    fsync: bool = True
    """fsync page files and directories (turn off only for throwaway tests)."""
    sync_after_commit: bool = True
    """With ``fsync``: a prefill commits once its files are written, and one background thread fsyncs them after
    (``store.background_sync``), so a prefill is not held to the disk's write speed (25 GB of pages and summaries
    at 128k tokens of Llama-3.1-8B). A process crash loses nothing; a power loss can lose the prefixes committed
    in the last seconds, which the next start verifies in full and drops when damaged (never served half-written).
    False: every file is fsync'd before the commit (the prefill waits for the disk)."""
    write_threads: int = 4
    """Threads a prefill's page writer overlaps per-page CRCs, file digests and durable writes on
    (layer l is checksummed and written while layer l+1 is computed and packed)."""
    pinned_staging_bytes: int = 4 << 30
    """Pinned host memory the store keeps for staging prefills' device layers (``store.pinned_pool``), reused
    across prefills: a prefill holds up to ``store.writer.MAX_PENDING_LAYERS`` (4) layers' page bytes
    (512 MiB each at 128k tokens of Llama-3.1-8B), so 4 GiB serves two such prefills at once. Past it, layers
    are staged in pageable memory (slower copies, no waiting). 0: no pool, each prefill allocates (and frees)
    its own pinned buffers."""
    metadata_url: str | None = None
    """Metadata backend: None or ``lmdb`` -> LMDB in ``home/meta``; ``lmdb:///path``; ``redis://host:port/db``."""
    metadata_namespace: str = "kvstash:"
    """Prefix of every Redis key this store writes (several stores can share one Redis)."""
    capacity_bytes: int | None = None
    """Bytes the store keeps (page files and artifacts): after each commit, least recently used prefixes that
    are neither pinned nor leased are evicted down to it. None: unlimited."""
    max_bytes_per_tenant: int | None = None
    """Bytes one tenant may store; a write that would exceed it is refused (QuotaExceeded). None: unlimited."""
    max_prefixes_per_tenant: int | None = None
    """Prefixes one tenant may store; a write beyond is refused (QuotaExceeded). None: unlimited."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home).expanduser())
        if not 1 <= self.page_size <= 4096:
            raise ValueError(f"page_size must be in [1, 4096], got {self.page_size}")
        if self.lmdb_map_size < 1 << 20:
            raise ValueError("lmdb_map_size must be at least 1 MiB")
        if not self.metadata_namespace:
            raise ValueError("metadata_namespace must not be empty")
        if self.pinned_staging_bytes < 0:
            raise ValueError(f"pinned_staging_bytes must be >= 0, got {self.pinned_staging_bytes}")
        for name in ("capacity_bytes", "max_bytes_per_tenant", "max_prefixes_per_tenant"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
