"""Product code outside ``store/`` reaches stored prefixes only through ``KVStore``.

Walks the AST of every module under the product packages: none may import a metadata backend
module or touch a store's backend attribute (``meta`` / ``_meta``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("workers", "services", "client", "bench", "lab")
"""Packages checked (``lab`` once it exists); ``store/`` itself owns its backends."""
BACKEND_MODULES = frozenset({"store.metadata", "store.metadata_factory", "store.lmdb_metadata",
                             "store.redis_metadata"})
BACKEND_ATTRS = frozenset({"meta", "_meta"})


def product_files(root: Path = REPO) -> list[Path]:
    """Every .py file of the product packages outside ``store/``."""
    return sorted(p for d in PRODUCT_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py")
                  if "gen" not in p.relative_to(root).parts)


def violations(source: str) -> list[str]:
    """Backend imports and backend attribute accesses in one module's source, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in BACKEND_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # ``from store import x``
            if names & BACKEND_MODULES:
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in BACKEND_ATTRS:
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_product_packages_are_found() -> None:
    files = {p.relative_to(REPO).parts[0] for p in product_files()}
    assert {"workers", "services", "client"} <= files


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_only_kvstore_reaches_the_metadata_backend(path: Path) -> None:
    assert violations(path.read_text()) == [], f"{path.relative_to(REPO)} goes around KVStore"


@pytest.mark.parametrize("planted", [
    "from store.metadata import lease_prefix",
    "from store.metadata_factory import open_metadata",
    "import store.lmdb_metadata",
    "from store import redis_metadata",
    "m = store.meta.manifest(pid)",
    "store._meta.pin(pid)",
])
def test_a_planted_violation_is_caught(planted: str) -> None:
    assert [v.split(":")[0] for v in violations(f"x = 1\n{planted}\n")] == ["2"]


def test_the_kvstore_api_and_artifact_keys_pass() -> None:
    assert violations("from store.kvstore import KVStore\nstore.find(pid)\nx = t['0.meta']\n") == []
