"""Keep freed activation memory in the process on a CPU, instead of page-faulting it back in.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves every block above its
mmap threshold (128 KiB at start, adapting up to 32 MiB) with a fresh ``mmap`` and returns it to
the kernel on free, so a forward pass that allocates its activations anew each step touches
fresh pages every time: radixkv-tiny's 4,096-token bf16 prefill took about 47,000 minor page
faults per call, ~30% of its time on one core (bench/bench_peers.py measures it). Raising
glibc's mmap and trim thresholds keeps those blocks in the heap, where the next step reuses
them: the same prefill then takes no page fault at all.

This is what PyTorch's CPU tuning guide gets by preloading jemalloc or tcmalloc, done in-process
with ``mallopt``. It is process-wide and only keeps memory the process already used (the peak
stays the peak); set ``RADIXKV_KEEP_FREED_MEMORY=0`` to leave ``malloc`` as it is. Elsewhere
than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to 256 MiB come from the heap (an 8,192-token bf16 MLP activation of an 8B model is
# 235 MB); larger ones (the KV pool) are still mapped on their own and returned when freed.
MMAP_THRESHOLD = 256 << 20
# Up to 1 GiB of free heap top is kept for the next step rather than trimmed.
TRIM_THRESHOLD = 1 << 30
ENV = "RADIXKV_KEEP_FREED_MEMORY"

_lock = threading.Lock()
_state: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc as described above, once per process; True when the tuning is in force."""
    global _state
    with _lock:
        if _state is None:
            _state = _apply()
        return _state


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 when glibc refuses the value
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
