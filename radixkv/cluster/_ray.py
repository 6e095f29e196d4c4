"""Importing Ray Serve without tripping warnings-as-errors setups.

Ray 2.60's own modules emit pydantic deprecation warnings at import time (``Field`` with extra
keyword arguments). They are Ray's, not ours or the user's, so they are silenced narrowly, once,
around the import; every other warning still reaches the caller.
"""

from __future__ import annotations

import warnings
from types import ModuleType

_RAY_IMPORT_WARNINGS = (
    "Using extra keyword arguments on `Field`",
    "`json_encoders` is deprecated",
    "Support for class-based `config` is deprecated",
)


def import_serve() -> ModuleType:
    """``ray.serve``, imported with Ray's import-time deprecation warnings silenced."""
    try:
        with warnings.catch_warnings():
            for msg in _RAY_IMPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=msg, category=DeprecationWarning)
            from ray import serve
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "radixkv.cluster needs Ray Serve: pip install 'radixkv[ray]' (ray[serve]==2.60.0)"
        ) from e
    return serve
