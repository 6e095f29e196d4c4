"""Each layer has one door (docs/architecture.md), kept as tests/test_import_graph.py keeps the
layers: read with ``ast``, so a reach hidden in a function or a lazy import counts too.

Server: radixkv/server/ and radixkv/cluster/ reach the engine only through ``AsyncEngine``,
whose one engine thread is the only one that touches the ``Engine``. Reaching past it
(``async_engine.engine.<anything>``, an alias of it, ``getattr(x, "engine")``, or importing the
``Engine`` class to drive one directly) would read or change the engine from the event loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import radixkv

_SERVER_ROOT = Path(radixkv.__file__).resolve().parent
_SERVER_DOOR_DIRS = ("server", "cluster")
# modules that hold the Engine class (importing it from a front end bypasses AsyncEngine)
_ENGINE_MODULES = {"radixkv.engine.engine"}
_ENGINE_NAMES = {("radixkv", "Engine"), ("radixkv.engine", "Engine")}


def _server_is_engine_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def _server_async_engine_names(tree: ast.AST) -> set[str]:
    """Local names that hold an AsyncEngine: assigned from ``<x>.engine`` (a front end's
    AsyncEngine attribute) or ``AsyncEngine(...)``, or annotated ``AsyncEngine``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        value: ast.AST | None = None
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            value, targets = node.value, list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            value, targets = node.value, [node.target]
            if "AsyncEngine" in ast.unparse(node.annotation) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            if "AsyncEngine" in ast.unparse(node.annotation):
                names.add(node.arg)
            continue
        elif isinstance(node, ast.NamedExpr):
            value, targets = node.value, [node.target]
        if value is None:
            continue
        holds = _server_is_engine_attr(value) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).endswith("AsyncEngine")
        )
        if holds:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _server_reaches(source: str) -> list[str]:
    """Each reach past AsyncEngine in ``source``, as ``line: code``."""
    tree = ast.parse(source)
    aliases = _server_async_engine_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        bad = False
        if _server_is_engine_attr(node):
            assert isinstance(node, ast.Attribute)
            base = node.value
            # x.engine.engine, or an AsyncEngine held in a local name, then .engine
            bad = _server_is_engine_attr(base) or (
                isinstance(base, ast.Name) and base.id in aliases
            )
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
                name = node.args[1]
                bad = isinstance(name, ast.Constant) and name.value == "engine"
        elif isinstance(node, ast.Import):
            bad = any(a.name in _ENGINE_MODULES for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            bad = mod in _ENGINE_MODULES or any(
                (mod, a.name) in _ENGINE_NAMES or f"{mod}.{a.name}" in _ENGINE_MODULES
                for a in node.names
            )
        if bad:
            found.append((getattr(node, "lineno", 0), ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(set(found))]


def test_server_door_finder_sees_every_kind_of_reach() -> None:
    reaches = [
        "x = st.engine.engine.cache",
        "core = self.st.engine\ncore.engine.weight_version",
        "def f(e: AsyncEngine):\n    return e.engine",
        "eng = AsyncEngine('m')\neng.engine.config",
        "getattr(st.engine, 'engine')",
        "from radixkv.engine.engine import Engine",
        "import radixkv.engine.engine",
        "from radixkv import Engine",
        "from radixkv.engine import engine",
    ]
    for src in reaches:
        assert _server_reaches(src), src
    doors = [
        "st.engine.info().weight_version",
        "await self.engine.add_cache_listener(fn)",
        "self.engine = engine",
        "Submission(st.engine, ids)",
        "from radixkv.engine.async_engine import AsyncEngine",
        "from radixkv.engine.params import SamplingParams",
    ]
    for src in doors:
        assert not _server_reaches(src), src


def test_server_door_is_the_only_way_to_the_engine() -> None:
    files = [p for d in _SERVER_DOOR_DIRS for p in sorted((_SERVER_ROOT / d).rglob("*.py"))]
    assert any(p.name == "state.py" for p in files) and any(
        p.name == "deployment.py" for p in files
    )
    bad = [
        f"{p.relative_to(_SERVER_ROOT.parent)}:{r}"
        for p in files
        for r in _server_reaches(p.read_text())
    ]
    assert not bad, "reaches past AsyncEngine:\n" + "\n".join(bad)
