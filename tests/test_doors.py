"""Each layer is reached through its one door, as tests/test_import_graph.py keeps the layers.

Calls are read with ``ast``, so they are found wherever they are written (a method, a lazy
import, a helper): a reach around a door is a path a reader has to follow, whether or not a
test runs it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import radixkv

ROOT = Path(radixkv.__file__).resolve().parent

# ---------------------------------------------------------------------------------------- engine
# The engine calls the cache through SeqKV (kv_manager.py); the storage tier (storage_tier.py)
# is the one other room that does: it lands prefetched pages in the host tier and observes the
# host pages to write. Every other engine module may build the cache and hand it over, never
# call it.
ENGINE_CACHE_ROOMS = ("kv_manager.py", "storage_tier.py")
_CACHE_TYPE = re.compile(r"\b\w*RadixCache\b")  # RadixCache and any subclass (tiered)


def _is_cache_type(annotation: ast.expr | None) -> bool:
    return annotation is not None and bool(_CACHE_TYPE.search(ast.unparse(annotation)))


def _builds_cache(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and bool(_CACHE_TYPE.search(ast.unparse(value.func)))


def _engine_cache_calls(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every use of a cache object's attributes in ``source``: on an
    attribute named ``cache`` or one a RadixCache is assigned to or annotated with, or on a
    name that holds one (annotated, built, or taken from such an attribute)."""
    tree = ast.parse(source)
    attrs = {"cache"}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _is_cache_type(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and _is_cache_type(node.annotation):
            t = node.target
            (attrs.add(t.attr) if isinstance(t, ast.Attribute) else names.add(ast.unparse(t)))
        elif isinstance(node, ast.Assign) and _builds_cache(node.value):
            for t in node.targets:
                (attrs.add(t.attr) if isinstance(t, ast.Attribute) else names.add(ast.unparse(t)))
    for node in ast.walk(tree):  # aliases: cache = self.cache
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in attrs
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Attribute) and v.attr in attrs) or (
            isinstance(v, ast.Name) and v.id in names
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_engine_door_finder_sees_cache_calls() -> None:
    src = """
from radixkv.cache import RadixCache, TieredRadixCache
class E:
    def __init__(self, pool):
        self.cache = RadixCache(pool, 4)
        self.tiers = TieredRadixCache(pool, 4)
        self.kv = SeqKV(self.cache)          # handing it over is fine
        self.stats = self.kv.cache_stats()   # a door
    def a(self):
        self.cache.wait_all()
    def b(self):
        return self.tiers.host_runs()
    def c(self):
        c = self.cache
        return c.namespaces
def f(x: RadixCache | None, y: "TieredRadixCache", z: int):
    x.poll(); y.stats; z.bit_length(); r.cache
"""
    calls = [e for _, e in _engine_cache_calls(src)]
    assert calls == [
        "self.cache.wait_all",
        "self.tiers.host_runs",
        "c.namespaces",
        "x.poll",
        "y.stats",
    ]
    assert _engine_cache_calls("class E:\n    def f(self):\n        return self.kv.stats()\n") == []


def test_engine_door_only_seqkv_and_the_storage_tier_call_the_cache() -> None:
    engine = ROOT / "engine"
    modules = sorted(engine.glob("*.py"))
    for room in ENGINE_CACHE_ROOMS:  # the doors exist, and the finder sees them used
        assert (engine / room) in modules, f"engine/{room} is gone: update ENGINE_CACHE_ROOMS"
        assert _engine_cache_calls((engine / room).read_text()), f"no cache call in {room}"
    reaches = [
        f"radixkv/engine/{p.name}:{line}: {expr}"
        for p in modules
        if p.name not in ENGINE_CACHE_ROOMS
        for line, expr in _engine_cache_calls(p.read_text())
    ]
    assert not reaches, (
        "engine code calls the cache around SeqKV (kv_manager.py) and the storage tier "
        "(storage_tier.py); add a SeqKV method instead:\n" + "\n".join(reaches)
    )


# ---------------------------------------------------------------------------------------- server
# radixkv/server/ and radixkv/cluster/ reach the engine only through ``AsyncEngine``, whose one
# engine thread is the only one that touches the ``Engine``. Reaching past it
# (``async_engine.engine.<anything>``, an alias of it, ``getattr(x, "engine")``, or importing the
# ``Engine`` class to drive one directly) would read or change the engine from the event loop.
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
