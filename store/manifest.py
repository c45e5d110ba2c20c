"""The manifest of a committed prefix: what was stored, how big, with which checksums."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from store.prefix_key import PrefixKey

MANIFEST_VERSION = 2
"""Version 2: page files may be checked by their page CRCs alone (``FileInfo.check``). Version 1 manifests (every
page file with a blake2b digest) load as before, and one whose files all carry a digest is still written as
version 1, byte for byte as before."""
READS_VERSIONS = (1, 2)
PAGE_CRC_ARTIFACT = "page_crc"
"""The artifact holding every page's keyed CRC ``uint32 [layers, kv_heads, pages]``."""
FILE_DIGEST = "blake2b"
"""``FileInfo.check`` of a page file with a blake2b digest of its whole (manifests written before version 2)."""
PAGE_CRCS = "page_crc"
"""``FileInfo.check`` of a page file checked by its keyed page CRCs alone (the ``page_crc`` artifact's entries,
that artifact covered by its own blake2b in the manifest): each byte of the file is in exactly one page."""


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    """One page file of a prefix: its name, size and how its bytes are checked (``check``)."""

    name: str
    size: int
    blake2b: str = ""
    """blake2b digest of the whole file when ``check`` is ``FILE_DIGEST``; empty when ``PAGE_CRCS``."""
    check: str = FILE_DIGEST
    """``FILE_DIGEST`` (the digest above; manifests written before version 2) or ``PAGE_CRCS``."""

    def __post_init__(self) -> None:
        if self.check not in (FILE_DIGEST, PAGE_CRCS):
            raise ValueError(f"unknown page file check {self.check!r}")
        if (self.check == FILE_DIGEST) != bool(self.blake2b):
            raise ValueError(f"page file {self.name}: a blake2b digest goes with check {FILE_DIGEST!r}, and only then")

    def to_dict(self) -> dict[str, Any]:
        """JSON fields: a file with a digest gives exactly the version 1 fields (no ``check``)."""
        if self.check == FILE_DIGEST:
            return {"name": self.name, "size": self.size, "blake2b": self.blake2b}
        return {"name": self.name, "size": self.size, "check": self.check}


@dataclass(frozen=True, kw_only=True)
class ArtifactInfo:
    """One artifact (summary or compressed variant): a file of the prefix directory, ``artifact_NNN.bin`` by its
    index in the manifest's (name-sorted) list; the metadata keeps this entry, never the bytes."""

    name: str
    size: int
    blake2b: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything needed to read a prefix back and check it; written last, when all is durable."""

    prefix_id: str
    key: PrefixKey
    model_name: str
    n_tokens: int
    files: tuple[FileInfo, ...]
    artifacts: tuple[ArtifactInfo, ...] = field(default=())
    state: str = "committed"
    created_at: float = 0.0
    tenant: str = "default"

    @property
    def layout(self):  # noqa: ANN201 - KVLayout, kept short
        """The KV layout of the prefix."""
        return self.key.layout

    @property
    def kv_bytes(self) -> int:
        """Total bytes of page files."""
        return sum(f.size for f in self.files)

    @property
    def artifact_bytes(self) -> int:
        """Total bytes of artifacts."""
        return sum(a.size for a in self.artifacts)

    def artifact(self, name: str) -> ArtifactInfo | None:
        """The artifact called ``name``, if stored."""
        return next((a for a in self.artifacts if a.name == name), None)

    def to_json(self) -> str:
        """Serialize to JSON."""
        d: dict[str, Any] = asdict(self)
        d["key"] = self.key.to_dict()
        d["files"] = [f.to_dict() for f in self.files]
        d["version"] = MANIFEST_VERSION if any(f.check != FILE_DIGEST for f in self.files) else 1
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> Manifest:
        """Parse JSON written by ``to_json``."""
        d = json.loads(s)
        if d.pop("version", None) not in READS_VERSIONS:
            raise ValueError("unsupported manifest version")
        d["key"] = PrefixKey.from_dict(d["key"])
        d["files"] = tuple(FileInfo(**f) for f in d["files"])
        d["artifacts"] = tuple(ArtifactInfo(**a) for a in d["artifacts"])
        return cls(**d)
