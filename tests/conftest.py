"""Shared test configuration: debug checks on, Hypothesis profiles.

The suite runs with ``RADIXKV_DEBUG_CHECKS=1`` (radixkv/debug.py): the model runner and the
attention backends re-check every batch they are handed, so a scheduler or backend bug fails
loudly here while production runs skip those checks.

Hypothesis profiles: ``ci`` (default): fixed seed (derandomized), sized so the state machines run
about a minute in all. ``fuzz`` (``nox -s fuzz``): many more examples, random seeds.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# read when a component is built, so setting it here (before any test runs) is early enough
os.environ.setdefault("RADIXKV_DEBUG_CHECKS", "1")
# the storage tier's MAC secret: fixed, so no test creates ~/.config/radixkv/storage_secret
os.environ.setdefault("RADIXKV_STORAGE_SECRET", "5e" * 32)

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "fuzz",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("RADIXKV_HYPOTHESIS_PROFILE", "ci"))
