"""The package's import graph has no cycle: a layer never imports back from a module it calls.

Imports are read with ``ast`` (including ones inside functions and TYPE_CHECKING blocks), so a
cycle hidden behind a lazy import counts too: it is still a circle a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import radixkv

ROOT = Path(radixkv.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """radixkv modules that ``path`` imports (a package import resolves to its __init__)."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                mod = ".".join([*anchor, mod]) if mod else ".".join(anchor)
            # `from pkg import sub` imports the submodule when one exists, else a name of pkg.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    known = set(files)
    return {name: _imports(p, name, known) for name, p in files.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    # A package's __init__ re-exporting its children is not a circle by itself: only edges
    # into a package __init__ from *outside* that package and edges out of modules count.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if n.startswith(m + "."):  # a module importing its own package's __init__
                continue
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_finder_sees_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_is_read() -> None:
    graph = _graph()
    assert "radixkv.cache.radix_cache" in graph
    assert "radixkv.cache.page_pool" in graph["radixkv.cache.radix_cache"]


def test_no_import_cycle_in_radixkv() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
