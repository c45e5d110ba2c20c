"""The store's resource limits as command-line flags, shared by the servers that open a store."""

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


def store_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The ``StoreConfig`` fields those flags set."""
    return {"capacity_bytes": args.capacity_bytes, "max_bytes_per_tenant": args.max_bytes_per_tenant,
            "max_prefixes_per_tenant": args.max_prefixes_per_tenant}
