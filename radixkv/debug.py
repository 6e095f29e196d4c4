"""Debug-only checks: re-validation of what one layer hands to the next, off in production.

The engine validates a request once, at intake (token ids inside the vocabulary, prompt plus
``max_tokens`` within the context, pages the pool can hold), and builds every page table
itself, so re-checking each step's batch in the model runner and the attention backends only
costs time. Those checks still catch a bug in a new scheduler or backend early, so they run
when ``RADIXKV_DEBUG_CHECKS`` is set to anything but ``""`` or ``"0"`` (the test suite sets it;
see tests/conftest.py), or when a component is constructed with its check flag set explicitly.
"""

from __future__ import annotations

import os

ENV_VAR = "RADIXKV_DEBUG_CHECKS"


def debug_checks_enabled() -> bool:
    """True when ``RADIXKV_DEBUG_CHECKS`` asks for the debug-only checks (read when a component
    is constructed, so a running engine never changes mode)."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")
