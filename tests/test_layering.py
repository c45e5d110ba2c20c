"""The import graph of the product: no cycles, no import against the layering.

Layers, bottom up: ``native`` <- ``store`` <- ``workers`` <- (``services``, ``lab``) <- ``client``; ``bench`` may
use everything. ``workers/kernels`` imports nothing of the project (only torch, triton, the standard library and
``native``, the stdlib-only C++ builder it shares with the store), so a kernel can be read, tested and tuned on its
own. Every import counts, including ones
inside functions and under ``TYPE_CHECKING``: a lazy import still points the dependency one way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("native", "store", "workers", "services", "lab", "client", "bench")
ALLOWED: dict[str, set[str]] = {
    "native": {"native"},  # the C++ kernel builder (stdlib only): both the store's page CRCs and workers/kernels use it
    "store": {"native", "store"},
    "workers": {"native", "store", "workers"},
    "services": {"native", "store", "workers", "services"},
    "lab": {"native", "store", "workers", "lab"},
    "client": {"native", "store", "workers", "services", "lab", "client"},
    "bench": set(PACKAGES),
}
"""Which top-level packages the modules of each package may import."""
KERNELS = "workers.kernels"
KERNEL_DEPS = ("workers.kernels", "native")
"""What a kernel may import of the project: other kernels, and the builder."""
GENERATED = "services.gen"


def module_name(path: Path) -> str:
    """``workers/methods/base.py`` -> ``workers.methods.base`` (a package is its ``__init__``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every product module (tests and generated stubs excluded), by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = module_name(path)
            if not name.startswith(GENERATED):
                out[name] = path
    return out


def _imported_names(tree: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(module, names taken from it) per import: ``import a.b`` -> (a.b, ()); ``from a import b`` -> (a, (b,))."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, tuple(alias.name for alias in node.names)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports. ``from pkg import mod`` points at ``pkg.mod`` only (the
    package's ``__init__`` runs first, but the dependency is on the module); names that are not
    modules point at ``pkg``."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for mod, names in _imported_names(tree, name, path.name == "__init__.py"):
            subs = {f"{mod}.{n}" for n in names} & modules.keys()
            targets |= subs
            if mod in modules and (not names or len(subs) < len(names)):
                targets.add(mod)
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` edges that point up the layers, or out of the kernels folder."""
    bad = []
    for src, targets in sorted(graph.items()):
        top = src.split(".")[0]
        for dst in sorted(targets):
            if dst.split(".")[0] not in ALLOWED[top]:
                bad.append(f"{src} -> {dst}")
            elif src.startswith(KERNELS) and not dst.startswith(KERNEL_DEPS):
                bad.append(f"{src} -> {dst} (kernels import nothing of the project)")
    return bad


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(project_modules())


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_imports_follow_the_layers(graph: dict[str, set[str]]) -> None:
    assert layering_violations(graph) == []


def test_the_checks_can_fail() -> None:
    """The checker finds a planted cycle and planted upward and kernel imports."""
    planted = {"store.a": {"store.b"}, "store.b": {"store.a", "workers.x"}, "workers.x": set(),
               "workers.kernels.k.ops": {"workers.x", "native.build"}, "client.c": {"store.a"},
               "native.build": {"store.a"}}
    assert cycles(planted) == [["store.a", "store.b"]]
    assert layering_violations(planted) == ["native.build -> store.a", "store.b -> workers.x",
                                            "workers.kernels.k.ops -> workers.x (kernels import nothing of the "
                                            "project)"]


def test_graph_sees_lazy_and_relative_imports() -> None:
    """Imports inside functions and ``from pkg import module`` both become edges."""
    tree = ast.parse("def f():\n    from store import kvstore\n    import workers.engine\n")
    assert set(_imported_names(tree, "client.cli", is_package=False)) == {("store", ("kvstore",)),
                                                                          ("workers.engine", ())}
    rel = ast.parse("from .base import Method\nfrom . import quest\n")
    assert set(_imported_names(rel, "workers.methods.topk", is_package=False)) == {
        ("workers.methods.base", ("Method",)), ("workers.methods", ("quest",))}
