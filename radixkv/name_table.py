"""NameTable: the table behind an extension point, names -> objects imported on first use.

An entry is either the object itself or the string ``"package.module:attribute"``, imported the
first time the name is looked up. So a table of heavy things (attention kernels, model families,
scheduling policies) can be listed, offered as command-line choices and checked against without
importing them: ``radixkv serve --help`` and ``EngineConfig(...)`` import no torch. Adding a
backend, a family or a storage scheme is adding a row (:meth:`NameTable.register`), and every
reader (the config's validation, the ``--help`` choices, the factory) sees it.

A name that is not in the table is a ValueError listing the known ones. ``extra`` names are
valid choices that the table's owner resolves before looking anything up (``"auto"``); they are
listed and accepted by ``in``, but :meth:`NameTable.get` refuses them. Iteration and ``in`` read
the table as it is now, so a table handed to argparse as ``choices`` lists late registrations too.

Not thread-safe to register into while others look up: tables are filled at import time or by a
test, before the engine runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


def import_target(ref: str) -> Any:
    """The object ``"package.module:attribute"`` names (``attribute`` may be dotted), imported
    now. ImportError / AttributeError when it is not there."""
    module, sep, attr = ref.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"a lazy target is 'package.module:attribute', got {ref!r}")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class NameTable(Generic[T]):
    """Names of one kind of thing (``what``: "attention backend") -> the thing, or the
    ``"module:attribute"`` it is imported from. ``T`` must not itself be ``str``."""

    __slots__ = ("_entries", "_extra", "what")

    def __init__(
        self, what: str, entries: Mapping[str, T | str] | None = None, *, extra: Sequence[str] = ()
    ) -> None:
        self.what = what
        self._extra = tuple(extra)
        self._entries: dict[str, T | str] = {}
        for name, target in (entries or {}).items():
            self.register(name, target)

    def register(self, name: str, target: T | str, *, replace: bool = False) -> None:
        """Add ``name`` -> ``target`` (an object, or ``"module:attribute"`` to import when first
        looked up). ValueError if ``name`` is empty, not a string, one of the ``extra`` names,
        or already registered (unless ``replace``), or if a string target has no ``:``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")
        if name in self._extra or (name in self._entries and not replace):
            raise ValueError(f"{self.what} {name!r} is already registered")
        if isinstance(target, str):
            module, sep, attr = target.partition(":")
            if not (module and sep and attr):
                raise ValueError(
                    f"{self.what} {name!r}: a lazy target is 'package.module:attribute', "
                    f"got {target!r}"
                )
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        """Remove ``name`` (ValueError listing the known names if it is not registered)."""
        self._check_entry(name)
        del self._entries[name]

    def get(self, name: str) -> T:
        """The object registered as ``name``, imported now if it was registered lazily.
        ValueError listing the known names for any other name (``extra`` ones included)."""
        self._check_entry(name)
        target = self._entries[name]
        if isinstance(target, str):
            self._entries[name] = target = cast("T", import_target(target))
        return cast("T", target)

    __getitem__ = get

    def check(self, name: object) -> str:
        """``name`` if it is one of :meth:`names`, else ValueError listing them."""
        if not isinstance(name, str) or name not in self:
            raise ValueError(self._unknown(name))
        return name

    def names(self) -> tuple[str, ...]:
        """The ``extra`` names, then the registered ones in registration order."""
        return (*self._extra, *self._entries)

    def _check_entry(self, name: object) -> None:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(self._unknown(name))

    def _unknown(self, name: object) -> str:
        return f"unknown {self.what} {name!r}; known: {', '.join(self.names())}"

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._extra)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._extra) + len(self._entries)

    def __repr__(self) -> str:
        return f"NameTable({self.what!r}, {list(self.names())})"
