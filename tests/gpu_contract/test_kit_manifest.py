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
    for dtype, hq, hkv, d, window, softcap in gpu_check.kernel_variants():
        tag = f"dtype_q_{SHORT[dtype]}_dtype_kv_{SHORT[dtype]}_dtype_o_{SHORT[dtype]}_dtype_idx_i32_head_dim_qk_{d}_"
        switches = f"use_swa_{window}_use_logits_cap_{softcap}"
        mine = [n for n in names if tag in n and switches in n]
        assert any(n.startswith("batch_prefill") and n.endswith("kv_stride_equal") for n in mine), (
            dtype,
            d,
        )  # FA2
        assert not any(n.endswith("_sm90") for n in mine), (dtype, d)  # no FA3: radixkv pins FA2
        cuda_core_decode = hq // hkv in (1, 2, 4)
        assert any(n.startswith("batch_decode") for n in mine) == cuda_core_decode, (dtype, hq, hkv)


def test_manifest_records_the_check_variants(manifest: dict) -> None:
    want = [
        {"dtype": str(dt).removeprefix("torch."), "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d,
         "sliding_window": w, "logits_soft_cap": c}
        for dt, hq, hkv, d, w, c in gpu_check.kernel_variants()
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


def test_kit_kernels_load_without_jit(tmp_path: Path) -> None:
    """Unpack the kit as run.sh does and ask flashinfer for every kernel the way the wrappers
    do, with JIT disabled: each comes from the kit (flashinfer's generators also read a few
    files of its data/csrc on the way, which the kit must carry). This Python's tvm_ffi stands
    in for the kit's cp312 wheel; an empty libcuda.so.1 stands in for the driver."""
    import os
    import shutil
    import subprocess
    import tarfile

    site = tmp_path / "site"
    with tarfile.open(KIT / "flashinfer-py.tar.xz") as tar:
        tar.extractall(site, filter="data")
    shutil.copytree(KIT / "aot", site / "flashinfer" / "data" / "aot")
    stub = tmp_path / "stub"
    stub.mkdir()
    shutil.copy2(gpu_kit.BUILD_DIR / "stub" / "libcuda.so", stub / "libcuda.so.1")
    cuda_lib = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"
    root = BENCH.parent
    code = (
        "import flashinfer, gpu_check, gpu_kit\n"
        f"assert flashinfer.__file__.startswith({str(site)!r}), flashinfer.__file__\n"
        "mods = gpu_kit.load_kernels(gpu_check.kernel_variants())\n"
        "print('loaded', len(mods))\n"
    )
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(root), str(BENCH), env.get("PYTHONPATH", "")]),
        FLASHINFER_DISABLE_JIT="1",
        FLASHINFER_WORKSPACE_BASE=str(tmp_path / "ws"),
        FLASHINFER_CUDA_ARCH_LIST=gpu_kit.CUDA_ARCH,
        LD_LIBRARY_PATH=os.pathsep.join([str(stub), str(cuda_lib), env.get("LD_LIBRARY_PATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from radixkv.attention.flashinfer_backend import decode_uses_tensor_cores

    variants = gpu_check.kernel_variants()
    cuda_core = sum(not decode_uses_tensor_cores(v[1], v[2]) for v in variants)
    assert f"loaded {1 + len(variants) + cuda_core}" in proc.stdout  # cascade, FA2s, decodes


def test_run_sh_unpacks_and_starts_the_check(tmp_path: Path) -> None:
    """run.sh on this CPU machine: it unpacks the kit (flashinfer, tvm-ffi, kernels in
    flashinfer/data/aot), starts bench/gpu_check.py, which finds no CUDA device and exits 2."""
    import os
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine run.sh runs the whole check")
    site = tmp_path / "site"
    env = dict(os.environ, PYTHON=sys.executable, GPU_KIT_SITE=str(site), OUT=str(tmp_path / "out"))
    proc = subprocess.run(
        ["bash", str(KIT / "run.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    aot = site / "flashinfer" / "data" / "aot"
    assert sorted(p.name for p in aot.iterdir()) == sorted(gpu_kit.required_modules())
    assert (site / "flashinfer" / "data" / "csrc").is_dir()
    # the kit's cp312 wheels (tvm-ffi, msgspec, outlines-core) unpack only for a Python 3.12;
    # any other Python keeps its own copies (here: this nox session's)
    if sys.version_info[:2] == (3, 12):
        assert (site / "tvm_ffi").is_dir() and (site / "msgspec").is_dir()
    else:
        assert not (site / "msgspec").exists() and "skipped msgspec-" in proc.stdout
    assert (site / "llguidance").is_dir()  # abi3: every CPython 3
