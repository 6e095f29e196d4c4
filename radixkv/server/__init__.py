"""OpenAI-compatible HTTP server for radixkv (``radixkv serve``).

``build_app(engine, config)`` gives the app (reusable elsewhere, e.g. behind Ray Serve);
``cli_entry(args)`` is what ``radixkv serve`` runs; ``add_serve_arguments(parser)`` declares its
flags (server/cli.py); ``BackgroundServer`` runs an app in a thread (server/background.py).
Imports are lazy so ``import radixkv.server`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "BackgroundServer": "radixkv.server.background",
    "ServerConfig": "radixkv.server.config",
    "add_serve_arguments": "radixkv.server.cli",
    "build_app": "radixkv.server.app",
    "build_from_args": "radixkv.server.cli",
    "cli_entry": "radixkv.server.cli",
    "main": "radixkv.server.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
