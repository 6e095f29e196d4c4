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
