"""The built GPU kit (bench/gpu_kit.py build; nox -s gpu_kit) covers every FlashInfer kernel
bench/gpu_check.py will ask for, computed from the check's own parameters, so a run on a lent GPU
never falls into a JIT compile (run.sh also forbids one). Collected only under nox -s gpu_kit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402
import gpu_kit  # noqa: E402

KIT = gpu_kit.KIT_DIR
SHORT = {torch.bfloat16: "bf16", torch.float16: "f16"}


@pytest.fixture(scope="module")
def manifest() -> dict:
    path = KIT / "manifest.json"
    assert path.exists(), "no kit: run `python bench/gpu_kit.py build`"
    return json.loads(path.read_text())


def test_manifest_covers_every_kernel_the_check_needs(manifest: dict) -> None:
    assert gpu_kit.check(KIT) == []
    have = {m["name"] for m in manifest["modules"]}
    assert set(gpu_kit.required_modules()) <= have


def test_required_kernels_follow_the_check_parameters() -> None:
    names = gpu_kit.required_modules()
    assert "cascade" in names  # merge_state / merge_state_in_place
    for dtype, hq, hkv, d in gpu_check.kernel_variants():
        tag = f"dtype_q_{SHORT[dtype]}_dtype_kv_{SHORT[dtype]}_dtype_o_{SHORT[dtype]}_dtype_idx_i32_head_dim_qk_{d}_"
        mine = [n for n in names if tag in n]
        assert any(n.startswith("batch_prefill") and n.endswith("kv_stride_equal") for n in mine), (
            dtype,
            d,
        )  # FA2
        assert not any(n.endswith("_sm90") for n in mine), (dtype, d)  # no FA3: radixkv pins FA2
        cuda_core_decode = hq // hkv in (1, 2, 4)
        assert any(n.startswith("batch_decode") for n in mine) == cuda_core_decode, (dtype, hq, hkv)


def test_manifest_records_the_check_variants(manifest: dict) -> None:
    want = [
        {"dtype": str(dt).removeprefix("torch."), "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d}
        for dt, hq, hkv, d in gpu_check.kernel_variants()
    ]  # fmt: skip
    assert manifest["variants"] == want
    assert manifest["flashinfer"] == gpu_kit.FLASHINFER_VERSION
    assert manifest["cuda_arch"] == "9.0a"


def test_kit_fits_one_call_and_runs_without_jit(manifest: dict) -> None:
    size = sum(p.stat().st_size for p in KIT.rglob("*") if p.is_file())
    assert size <= 60 * 1024 * 1024
    run = (KIT / "run.sh").read_text()
    assert "FLASHINFER_DISABLE_JIT=1" in run and "bench/gpu_check.py" in run
    for m in manifest["modules"]:
        so = KIT / "aot" / m["name"] / f"{m['name']}.so"
        assert so.stat().st_size == m["bytes"]
        assert so.read_bytes()[:4] == b"\x7fELF"
