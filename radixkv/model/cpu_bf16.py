"""Does this CPU multiply bfloat16 natively? The fact ``dtype="auto"`` needs on a CPU.

On a CPU with bf16 dot-product instructions (x86 AVX512-BF16, or AMX tiles with AMX-BF16)
PyTorch's oneDNN matmuls run bfloat16 several times faster than float32 (measured on a 2-core
AVX512-BF16 machine: about 470 vs 105 GFLOP/s per core). Without them oneDNN emulates bf16 on
float32 units and conversion loops, and bfloat16 is no faster, often slower, than float32.

The evidence, in order:

1. PyTorch's own CPU feature probe (``torch.cpu._is_avx512_bf16_supported`` and
   ``_is_amx_tile_supported``: what its kernels dispatch on); private, so looked up defensively;
2. otherwise the kernel's CPU flags in ``/proc/cpuinfo`` (``avx512_bf16``, ``amx_bf16``).

Both also need a PyTorch built with oneDNN (``torch.backends.mkldnn``), which runs the bf16
matmuls. Other CPUs (ARM included, where this has not been measured) report no native bf16;
passing ``dtype="bfloat16"`` explicitly still works everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

# /proc/cpuinfo flags of x86 bf16 matrix or dot-product units
_CPUINFO_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuBf16:
    """``native``: bf16 matmuls run on native units; ``evidence``: what said so (for logs)."""

    native: bool
    evidence: str


def _torch_probe() -> list[str] | None:
    """Names of the bf16 features PyTorch's CPU probe reports, or None without the probe."""
    probes = {
        "avx512_bf16": getattr(torch.cpu, "_is_avx512_bf16_supported", None),
        "amx": getattr(torch.cpu, "_is_amx_tile_supported", None),
    }
    if all(p is None for p in probes.values()):
        return None
    found = []
    for name, probe in probes.items():
        try:
            if probe is not None and probe():
                found.append(name)
        except (RuntimeError, AttributeError):  # a build without cpuinfo: no evidence
            continue
    return found


def _cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU flags the kernel lists (first processor), or None where there is no such file."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def detect_cpu_bf16(
    torch_probe: list[str] | None = None,
    cpuinfo_flags: set[str] | None = None,
    *,
    onednn: bool | None = None,
) -> CpuBf16:
    """The decision from the evidence given: PyTorch's probe (None: this PyTorch has none),
    else the cpuinfo flags (None: no such file); ``onednn`` defaults to this PyTorch's."""
    if onednn is None:
        onednn = torch.backends.mkldnn.is_available()
    if not onednn:
        return CpuBf16(False, "PyTorch built without oneDNN (bf16 matmuls are emulated)")
    if torch_probe:
        return CpuBf16(True, "PyTorch CPU probe: " + ", ".join(torch_probe))
    if torch_probe is not None:
        return CpuBf16(False, "PyTorch CPU probe: no AVX512-BF16 or AMX")
    flags = cpuinfo_flags or set()
    found = [f for f in _CPUINFO_FLAGS if f in flags]
    if found:
        return CpuBf16(True, "/proc/cpuinfo flags: " + ", ".join(found))
    return CpuBf16(False, "no bf16 matrix flags (avx512_bf16, amx_bf16) in /proc/cpuinfo")


@functools.cache
def cpu_bf16() -> CpuBf16:
    """This machine's answer (computed once per process)."""
    probe = _torch_probe()
    return detect_cpu_bf16(probe, None if probe is not None else _cpuinfo_flags())
