"""The prefix key: everything that changes a prefix's stored bytes, hashed into its id."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from store.errors import InvalidInput
from store.layout import KVLayout

PREFIX_KEY_VERSION = 1
PREFIX_ID_CHARS = 32
"""Length of a prefix id: that many lowercase hex characters of a sha256."""
_PREFIX_ID = re.compile(f"[0-9a-f]{{{PREFIX_ID_CHARS}}}")


def token_hash(token_ids: list[int]) -> str:
    """A stable hash of a token id sequence."""
    h = hashlib.sha256()
    h.update(len(token_ids).to_bytes(8, "little"))
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


def check_prefix_id(prefix_id: object) -> str:
    """``prefix_id`` when it has the form ``PrefixKey.prefix_id`` gives ids; InvalidInput otherwise.

    Ids become file names and metadata keys: anything else (empty, ``../``, NUL bytes) stops here.
    """
    if not isinstance(prefix_id, str) or _PREFIX_ID.fullmatch(prefix_id) is None:
        raise InvalidInput(f"prefix id must be {PREFIX_ID_CHARS} lowercase hex characters")
    return prefix_id


def tenant_salt(tenant: str, secret: str = "") -> str:
    """The per-tenant salt; with a server secret, one tenant cannot compute another's ids."""
    return hashlib.blake2b(tenant.encode(), key=secret.encode()[:64], digest_size=16).hexdigest()


@dataclass(frozen=True, kw_only=True)
class PrefixKey:
    """Identity of a stored prefix. Same document, model, tenant and layout -> same id."""

    model_fingerprint: str
    tenant_salt: str
    token_hash: str
    layout: KVLayout
    summarizers: tuple[tuple[str, int], ...] = field(default=())

    @property
    def prefix_id(self) -> str:
        """The prefix id: ``PREFIX_ID_CHARS`` hex chars of a sha256 over the canonical JSON of this key."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:PREFIX_ID_CHARS]

    def canonical(self) -> str:
        """Canonical JSON (sorted keys) of the key."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (round-trips through ``from_dict``)."""
        return {
            "version": PREFIX_KEY_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "tenant_salt": self.tenant_salt,
            "token_hash": self.token_hash,
            "layout": self.layout.to_dict(),
            "summarizers": [list(s) for s in self.summarizers],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefixKey:
        """Inverse of ``to_dict``."""
        if d.get("version") != PREFIX_KEY_VERSION:
            raise ValueError(f"unsupported prefix key version {d.get('version')}")
        return cls(
            model_fingerprint=d["model_fingerprint"],
            tenant_salt=d["tenant_salt"],
            token_hash=d["token_hash"],
            layout=KVLayout.from_dict(d["layout"]),
            summarizers=tuple((str(n), int(v)) for n, v in d["summarizers"]),
        )
