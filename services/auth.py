"""API keys -> tenants, shared by the gateway and the gRPC servers."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from store.errors import Unauthenticated

API_KEYS_ENV = "KVSTASH_API_KEYS"
"""``key1:tenant1,key2:tenant2``; unset or empty disables auth (every caller is tenant ``default``)."""
TENANT_SECRET_ENV = "KVSTASH_TENANT_SECRET"
"""Keys the per-tenant salt of prefix ids, so no tenant can compute another's ids."""
API_KEY_HEADER = "x-api-key"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ApiKeys:
    """The key table; an empty table means auth is off."""

    keys: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> ApiKeys:
        """Parse ``key:tenant`` pairs separated by commas."""
        table: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, sep, tenant = item.partition(":")
            if not sep or not key or not tenant:
                raise ValueError(f"bad API key entry {item!r}: expected key:tenant")
            table[key] = tenant
        return cls(table)

    @classmethod
    def from_env(cls) -> ApiKeys:
        """The table from ``$KVSTASH_API_KEYS``."""
        return cls.parse(os.environ.get(API_KEYS_ENV, ""))

    @property
    def enabled(self) -> bool:
        """Whether keys are required."""
        return bool(self.keys)

    def tenant(self, key: str | None) -> str:
        """The tenant of ``key``; Unauthenticated when auth is on and the key is missing or unknown."""
        if not self.enabled:
            return DEFAULT_TENANT
        if key:
            for known, tenant in self.keys.items():
                if hmac.compare_digest(known.encode(), key.encode()):  # constant time: no key probing
                    return tenant
        raise Unauthenticated("missing or invalid API key")


def bearer_key(authorization: str | None, api_key: str | None) -> str | None:
    """The API key from an ``Authorization: Bearer`` header or an ``X-API-Key`` header."""
    if api_key:
        return api_key
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def tenant_secret() -> str:
    """The server secret for tenant salts (empty when unset)."""
    return os.environ.get(TENANT_SECRET_ENV, "")
