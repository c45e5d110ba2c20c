"""Credentials: tenant API keys (gateway and worker) and the service token (store service), kept apart."""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from store.errors import Unauthenticated

log = logging.getLogger(__name__)

API_KEYS_ENV = "KVSTASH_API_KEYS"
"""``key1:tenant1,key2:tenant2``; servers refuse to start without it unless told to run without auth."""
TENANT_SECRET_ENV = "KVSTASH_TENANT_SECRET"
"""Keys the per-tenant salt of prefix ids, so no tenant can compute another's ids."""
API_KEY_HEADER = "x-api-key"
DEFAULT_TENANT = "default"
SERVICE_TOKEN_ENV = "KVSTASH_SERVICE_TOKEN"
"""The credential services (gateway, workers) present to the store service; never a tenant key."""
SERVICE_TOKEN_HEADER = "x-kvstash-service-token"
TENANT_HEADER = "x-kvstash-tenant"
"""The tenant a service call acts for: trusted only beside a valid service token."""
INSECURE_NO_AUTH_ENV = "KVSTASH_INSECURE_NO_AUTH"
"""``1``: the gateway and the worker may start without API keys (every caller is tenant ``default``)."""
MIN_SERVICE_TOKEN_CHARS = 16
TENANT_MAX_CHARS = 128


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


@dataclass(frozen=True)
class ServiceToken:
    """The store service's credential: services send it with the tenant they act for."""

    token: str = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.token) < MIN_SERVICE_TOKEN_CHARS or not self.token.isascii() or not self.token.isprintable():
            raise ValueError(f"{SERVICE_TOKEN_ENV} must be at least {MIN_SERVICE_TOKEN_CHARS} printable ASCII "
                             "characters")

    @classmethod
    def from_env(cls) -> ServiceToken | None:
        """The token from ``$KVSTASH_SERVICE_TOKEN`` (None when unset or empty)."""
        token = os.environ.get(SERVICE_TOKEN_ENV, "").strip()
        return cls(token) if token else None

    def accepts(self, presented: str | bytes | None) -> bool:
        """Whether ``presented`` is this token (constant time: no token probing)."""
        if isinstance(presented, str):
            presented = presented.encode()
        return presented is not None and hmac.compare_digest(self.token.encode(), presented)

    def metadata(self, tenant: str) -> list[tuple[str, str]]:
        """gRPC metadata of a service call acting for ``tenant``."""
        return [(SERVICE_TOKEN_HEADER, self.token), (TENANT_HEADER, tenant)]

    def check_distinct(self, keys: ApiKeys) -> None:
        """Refuse a token that is also a tenant's API key (a tenant could then call the store)."""
        if any(hmac.compare_digest(k.encode(), self.token.encode()) for k in keys.keys):
            raise ValueError(f"{SERVICE_TOKEN_ENV} must differ from every tenant API key")


def service_metadata(token: ServiceToken | None, tenant: str) -> list[tuple[str, str]]:
    """Metadata of a store call for ``tenant`` (only the tenant when no token is configured: insecure stores)."""
    return token.metadata(tenant) if token else [(TENANT_HEADER, tenant)]


def insecure_no_auth(flag: bool) -> bool:
    """Whether running without API keys was asked for (``--insecure-no-auth`` or ``$KVSTASH_INSECURE_NO_AUTH=1``)."""
    return flag or os.environ.get(INSECURE_NO_AUTH_ENV, "").strip() == "1"


def require_api_keys(keys: ApiKeys, insecure: bool, server: str) -> None:
    """Refuse to serve without API keys unless ``insecure``; warn loudly when serving without them."""
    if keys.enabled:
        return
    if not insecure:
        raise SystemExit(f"{server}: refusing to start without {API_KEYS_ENV} (key:tenant,...); for local "
                         f"development pass --insecure-no-auth or set {INSECURE_NO_AUTH_ENV}=1")
    log.warning("%s: INSECURE: no %s, authentication is OFF and every caller is tenant %r; never expose this "
                "port to a network", server, API_KEYS_ENV, DEFAULT_TENANT)


def service_token_or_exit(server: str, insecure: bool, insecure_flag: str, keys: ApiKeys) -> ServiceToken | None:
    """``$KVSTASH_SERVICE_TOKEN``; exits when it is malformed, equals one of ``keys``, or is missing (unless
    ``insecure``)."""
    try:
        token = ServiceToken.from_env()
        if token:
            token.check_distinct(keys)
    except ValueError as e:
        raise SystemExit(f"{server}: {e}") from None
    if token is None and not insecure:
        raise SystemExit(f"{server}: refusing to start without {SERVICE_TOKEN_ENV} (the credential services present "
                         f"to the store); for loopback development pass {insecure_flag}")
    if token is None:
        log.warning("%s: INSECURE: no %s, store calls carry no service credential; loopback development only",
                    server, SERVICE_TOKEN_ENV)
    return token
