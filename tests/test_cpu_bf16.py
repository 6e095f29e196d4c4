"""CPU facts the dtype choice and the CPU forward rely on: native bf16 detection (from PyTorch's
probe or /proc/cpuinfo flags) and glibc keeping freed activation memory."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixkv.model import cpu_malloc
from radixkv.model.cpu_bf16 import _cpuinfo_flags, cpu_bf16, detect_cpu_bf16


def test_torch_probe_decides_when_present() -> None:
    yes = detect_cpu_bf16(["avx512_bf16"], None, onednn=True)
    assert yes.native and "avx512_bf16" in yes.evidence
    # the probe's "no" wins over flags: PyTorch's kernels dispatch on what it sees
    no = detect_cpu_bf16([], {"avx512_bf16"}, onednn=True)
    assert not no.native and "probe" in no.evidence


def test_cpuinfo_flags_decide_without_probe() -> None:
    assert detect_cpu_bf16(None, {"avx2", "amx_bf16", "amx_tile"}, onednn=True).native
    assert detect_cpu_bf16(None, {"avx512f", "avx512_bf16"}, onednn=True).native
    plain = detect_cpu_bf16(None, {"avx2", "avx512f", "fma"}, onednn=True)
    assert not plain.native and "no bf16" in plain.evidence
    assert not detect_cpu_bf16(None, None, onednn=True).native  # no /proc/cpuinfo at all


def test_without_onednn_bf16_is_never_native() -> None:
    got = detect_cpu_bf16(["avx512_bf16", "amx"], {"amx_bf16"}, onednn=False)
    assert not got.native and "oneDNN" in got.evidence


def test_cpuinfo_parser(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n")
    assert _cpuinfo_flags(f) == {"fpu", "avx2", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert "bf16" in (_cpuinfo_flags(arm) or set())
    assert _cpuinfo_flags(tmp_path / "missing") is None


def test_this_machine_agrees_with_its_evidence() -> None:
    got = cpu_bf16()
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and torch.backends.mkldnn.is_available():
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        assert got.native == (probe() or amx)
    assert got.evidence


_FAULTS_OF_A_FORWARD = """
import resource, torch
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, SeqInput
torch.set_num_threads(1)
lm = load_model("radixkv-tiny-random")
c = lm.config
runner = ModelRunner(lm.model, KVPool(c.num_layers, 66, 16, c.num_kv_heads, c.head_dim))
ids, pages = [7] * 1024, list(range(64))
for _ in range(3):  # steady state: the allocator has seen this step's blocks
    runner.forward([SeqInput(ids, pages, 0)])
counts = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    runner.forward([SeqInput(ids, pages, 0)])
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the median: the kernel now and then faults a few 2 MB huge pages back in on its own
# (compaction, THP splits), in any process; what glibc does shows up in every step
print(sorted(counts)[2])
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_a_cpu_forward_reuses_its_memory_instead_of_faulting_it_in() -> None:
    def faults(keep: str) -> int:
        env = {**os.environ, cpu_malloc.ENV: keep}
        done = subprocess.run(
            [sys.executable, "-c", _FAULTS_OF_A_FORWARD], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    kept, plain = faults("1"), faults("0")
    # a 1,024-token fp32 prefill of the tiny model allocates ~80 MB of activations per step;
    # glibc's default maps and unmaps the largest afresh each step (thousands of page faults)
    assert plain > 3000
    assert kept < plain // 20


def test_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_state", None)
    monkeypatch.setenv(cpu_malloc.ENV, "0")
    assert cpu_malloc.keep_freed_memory() is False
