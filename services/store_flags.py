"""The store's resource limits and durability as command-line flags, shared by the servers that open a store."""

from __future__ import annotations

import argparse
from typing import Any


def add_store_limit_args(p: argparse.ArgumentParser) -> None:
    """Flags for capacity eviction and per-tenant quotas (each unlimited unless given)."""
    p.add_argument("--capacity-bytes", type=int, default=None,
                   help="evict least recently used prefixes (never pinned or leased) above this many bytes")
    p.add_argument("--max-bytes-per-tenant", type=int, default=None,
                   help="refuse a tenant's writes (RESOURCE_EXHAUSTED / 429) beyond this many stored bytes")
    p.add_argument("--max-prefixes-per-tenant", type=int, default=None,
                   help="refuse a tenant's writes (RESOURCE_EXHAUSTED / 429) beyond this many prefixes")
    p.add_argument("--sync-before-commit", action="store_true",
                   help="fsync every file of a prefill before it is committed (the prefill waits for the disk); "
                        "default: committed once written, fsync'd in the background, verified at start after a crash")


def store_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The ``StoreConfig`` fields those flags set."""
    return {"capacity_bytes": args.capacity_bytes, "max_bytes_per_tenant": args.max_bytes_per_tenant,
            "max_prefixes_per_tenant": args.max_prefixes_per_tenant, "sync_after_commit": not args.sync_before_commit}
