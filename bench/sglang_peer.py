"""SGLang's own prefix caches, loaded standalone from its wheel, for bench/bench_vs_sglang.py.

The sglang wheel (``pip download --no-deps sglang==<version>``: no dependency is installed)
holds both of SGLang's radix caches: the pure-Python ``RadixCache``
(sglang/srt/mem_cache/radix_cache.py) and the production backend, a Rust tree core compiled
into a PyO3 extension (sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so). Neither needs
SGLang's server: this module extracts the few files they use into a cache folder and imports
them with every other ``sglang.*`` module replaced by an empty stand-in (the Python cache's
hot paths never touch those: they are metrics, kernels, environment switches and type
imports). The Rust extension links against libtorch; importing torch first makes its
libraries resident, so the extension loads against the torch of this environment.

pip picks the wheel built for this machine; SGLang publishes Linux wheels (the extension is
CPython- and platform-specific). Nothing here is imported by radixkv; it is benchmark tooling
(not run in CI: it downloads).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

from peerkit import pip_download

SGLANG_VERSION = "0.5.23"
DEFAULT_CACHE = Path.home() / ".cache" / "radixkv-bench"

# The real SGLang modules the Python RadixCache runs (everything else under sglang.* is a
# stand-in). The package __init__ files are not run: the packages are made empty.
_REAL_MODULES = (
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.utils",
)
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache")
_RUST_DIR = "sglang/srt/mem_cache/rust_tree_core/"
_RUST_MODULE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"


def fetch_wheel(version: str = SGLANG_VERSION, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The sglang wheel in ``cache_dir``, downloaded with pip (no dependencies) if missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if not found:
        pip_download(cache_dir, "--quiet", f"sglang=={version}")
        found = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download gave no sglang-{version} wheel in {cache_dir}")
    return found[-1]


def extract(wheel: Path, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Unpack the files the two caches need; return the folder that holds ``sglang/``."""
    root = cache_dir / wheel.stem
    wanted = [m.replace(".", "/") + ".py" for m in _REAL_MODULES]
    with zipfile.ZipFile(wheel) as z:
        wanted += [
            n for n in z.namelist() if n.startswith(_RUST_DIR + "mem_cache.") and n.endswith(".so")
        ]
        for name in wanted:
            if not (root / name).exists():
                z.extract(name, root)
    return root


def _rust_so(root: Path) -> Path:
    found = sorted((root / _RUST_DIR).glob("mem_cache.*.so"))
    if not found:
        raise ImportError(f"no compiled Rust tree core under {root / _RUST_DIR}")
    return found[0]


class _Anything:
    """A stand-in for any name a stand-in module is asked for: callable, subclassable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        # a class, so that ``class X(Name)`` and ``Name(...)`` both work
        return type(name, (_Anything,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Real files for the modules in _REAL_MODULES, stand-ins for every other sglang.*."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in _REAL_MODULES:
            file = self.root / (fullname.replace(".", "/") + ".py")
            return importlib.util.spec_from_file_location(fullname, file)
        is_pkg = fullname in _PACKAGES or fullname == _RUST_MODULE.rsplit(".", 1)[0]
        if fullname == _RUST_MODULE:
            return None  # loaded by load_rust_core from its file
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = _StubModule(spec.name)
        if spec.name in _PACKAGES:
            mod.__path__ = [str(self.root / spec.name.replace(".", "/"))]
        else:
            mod.__path__ = []  # lets stand-in sub-packages import their stand-in children
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install(root: Path) -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(root))


def load_python_cache(root: Path) -> types.ModuleType:
    """SGLang's radix_cache module (RadixCache, RadixKey, ...), the real file."""
    import torch  # noqa: F401  (radix_cache imports it; loaded before the stand-ins)

    _install(root)
    import importlib

    return importlib.import_module("sglang.srt.mem_cache.radix_cache")


def load_python_params(root: Path) -> types.ModuleType:
    """SGLang's base_prefix_cache module (MatchPrefixParams, InsertParams, ...)."""
    _install(root)
    import importlib

    return importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")


def load_rust_core(root: Path) -> types.ModuleType:
    """The PyO3 extension of SGLang's Rust tree core (RustUnifiedTreeCoreBinding, ...)."""
    import torch  # noqa: F401  (makes libtorch resident before the extension is opened)

    if _RUST_MODULE in sys.modules:
        return sys.modules[_RUST_MODULE]
    so = _rust_so(root)
    spec = importlib.util.spec_from_file_location(_RUST_MODULE, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[_RUST_MODULE] = mod
    return mod
