"""The manifest of a committed prefix: what was stored, how big, with which checksums."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from store.prefix_key import PrefixKey

MANIFEST_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    """One page file of a prefix: its name, size and blake2b digest."""

    name: str
    size: int
    blake2b: str


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
        d["version"] = MANIFEST_VERSION
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> Manifest:
        """Parse JSON written by ``to_json``."""
        d = json.loads(s)
        if d.pop("version", None) != MANIFEST_VERSION:
            raise ValueError("unsupported manifest version")
        d["key"] = PrefixKey.from_dict(d["key"])
        d["files"] = tuple(FileInfo(**f) for f in d["files"])
        d["artifacts"] = tuple(ArtifactInfo(**a) for a in d["artifacts"])
        return cls(**d)
