"""Shared test configuration: Hypothesis profiles.

``ci`` (default): fixed seed (derandomized), sized so the state machines run about a minute in all.
``fuzz`` (``nox -s fuzz``): many more examples, random seeds.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
