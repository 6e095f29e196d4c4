"""CPU contract tests of the FlashInfer backends against the real ``flashinfer`` package.

They need flashinfer-python installed (``nox -s gpu_contract`` installs the pinned version in its
own virtual environment; the default test run has no flashinfer). Where flashinfer is absent
this folder collects nothing, so the default run shows neither these tests nor skips; under
``nox -s gpu_contract`` (RADIXKV_GPU_CONTRACT=1) a missing flashinfer is an error instead.
``test_kit_manifest.py`` checks a built GPU kit and is collected only under ``nox -s gpu_kit``
(RADIXKV_GPU_KIT=1).
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("flashinfer") is None:
    if os.environ.get("RADIXKV_GPU_CONTRACT") or os.environ.get("RADIXKV_GPU_KIT"):
        raise RuntimeError(
            "the GPU contract tests need flashinfer-python (nox -s gpu_contract installs it)"
        )
    collect_ignore_glob = ["test_*.py"]
elif not os.environ.get("RADIXKV_GPU_KIT"):
    collect_ignore_glob = ["test_kit_manifest.py"]
