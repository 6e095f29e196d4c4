"""Build the GPU kit: everything bench/gpu_check.py needs on a lent GPU machine that has no
flashinfer and no package registry, in one git-ignored folder small enough to carry (< 60 MiB).

What goes in (``.gpu-kit/`` by default):

* ``flashinfer-py.tar.xz``: flashinfer's Python files from the pinned wheel (its CUDA sources,
  CUTLASS and CCCL headers are left out: nothing is compiled on the GPU machine);
* the cp312 ``apache-tvm-ffi`` wheel flashinfer loads its kernels with, and cp312 wheels of
  radixkv's own dependencies the lent machine's image lacks (``RUNTIME_WHEELS``);
* ``aot/NAME/NAME.so``: the kernels compiled ahead of time here for Hopper (sm_90a), exactly the
  variants the check asks for (:func:`required_modules`, computed from
  ``gpu_check.kernel_variants()``); ``run.sh`` puts them where flashinfer looks for ahead-of-time
  kernels (``flashinfer/data/aot/NAME/NAME.so``) and sets ``FLASHINFER_DISABLE_JIT=1`` so a
  missing kernel fails at once instead of trying to compile;
* ``run.sh`` (unpacks into /tmp, sets PYTHONPATH, runs bench/gpu_check.py) and
  ``manifest.json`` (versions, modules, sizes, build times).

    python bench/gpu_kit.py build     # needs flashinfer-python (pinned) and nvcc; slow: minutes
    python bench/gpu_kit.py check     # the kit's manifest covers every kernel the check needs
    python bench/gpu_kit.py modules   # print the kernels the check needs

``nox -s gpu_kit`` installs the pinned flashinfer and does build + check. Compiling honours
``MAX_JOBS`` (default 1; ninja jobs) and runs nvcc at low priority.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / ".gpu-kit"
BUILD_DIR = ROOT / ".gpu-kit-build"  # wheel cache, nvcc scratch; never carried

# The FlashInfer release the backends are written for and checked against (pyproject's `gpu`
# extra, noxfile's gpu_contract/gpu_kit sessions and docs/gpu.md name the same one).
FLASHINFER_VERSION = "0.7.4"
TVM_FFI_VERSION = "0.1.15.post2"  # flashinfer 0.7.4 needs apache-tvm-ffi>=0.1.11,<0.2
# radixkv's dependencies that the H200 image (library/device/KINDS.md's package list) does not
# hold, carried as wheels for cp312 (or abi3): msgspec (configs, outputs), outlines-core (guided
# decoding) and llguidance (grammars; imported only when a grammar is used, but a dependency)
RUNTIME_WHEELS = ("msgspec==0.23.0", "outlines-core==0.2.14", "llguidance==1.9.1")
CURAND_VERSION = "10.4.4.72"  # headers only: FA3's CUTLASS includes curand_kernel.h
CUDA_ARCH = "9.0a"  # H100/H200 (Hopper); FA3 kernels need the "a" features
TARGET_PYTHON = "3.12"  # the lent machine's python3
KIT_LIMIT_BYTES = 60 * 1024 * 1024
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_31_x86_64",  # llguidance's wheels (the image's Python 3.12 has a newer glibc)
    "manylinux2014_x86_64",
)

RUN_SH = """#!/usr/bin/env bash
# Run bench/gpu_check.py from this kit on a CUDA machine (no flashinfer, no registry needed):
#     bash .gpu-kit/run.sh            # results under $OUT (else bench/results/)
# Built by bench/gpu_kit.py for flashinfer {fi_version}, sm_{arch}, Python {py}.
set -euo pipefail
KIT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
ROOT="$(cd "$KIT/.." && pwd)"
PY="${{PYTHON:-python3}}"
SITE="${{GPU_KIT_SITE:-/tmp/radixkv-gpu-kit-site}}"
rm -rf "$SITE" && mkdir -p "$SITE"
"$PY" - "$KIT" "$SITE" <<'EOF'
import shutil, sys, tarfile, zipfile
from pathlib import Path
kit, site = Path(sys.argv[1]), Path(sys.argv[2])
with tarfile.open(kit / "flashinfer-py.tar.xz") as tar:
    tar.extractall(site, filter="data")
here = f"cp{{sys.version_info[0]}}{{sys.version_info[1]}}"
for wheel in sorted(kit.glob("*.whl")):
    abi = wheel.name.split("-")[-2]  # cp312, or abi3 / none (any CPython 3)
    if abi.startswith("cp") and abi != here:  # built for another Python: keep this one's own
        print(f"gpu kit: skipped {{wheel.name}} (this Python is {{here}})", flush=True)
        continue
    zipfile.ZipFile(wheel).extractall(site)
shutil.copytree(kit / "aot", site / "flashinfer" / "data" / "aot")
print(f"gpu kit: unpacked into {{site}}", flush=True)
EOF
export PYTHONPATH="$SITE:$ROOT${{PYTHONPATH:+:$PYTHONPATH}}"
export FLASHINFER_DISABLE_JIT=1  # every kernel is in the kit; never compile on the GPU machine
export FLASHINFER_WORKSPACE_BASE="${{FLASHINFER_WORKSPACE_BASE:-/tmp/radixkv-flashinfer}}"
export FLASHINFER_CUDA_ARCH_LIST="{arch}"
export PYTHONUNBUFFERED=1
export GPU_KIT_MANIFEST="$KIT/manifest.json"
exec "$PY" "$ROOT/bench/gpu_check.py" "$@"
"""


# ------------------------------------------------------------------------------------------------
# Which kernels: from the check's own parameters
def _check_module() -> Any:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    return gpu_check


def _set_build_env() -> None:
    """Before flashinfer is imported: its JIT folder, target arch and CUDA location."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(BUILD_DIR / "ws"))
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = CUDA_ARCH
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def required_specs(variants: list[tuple[Any, int, int, int, bool, bool]]) -> dict[str, Any]:
    """flashinfer JIT specs (by module name) the backends can load for these attention variants
    ``(dtype, num_qo_heads, num_kv_heads, head_dim, sliding_window, logits_soft_cap)`` on Hopper.

    Per shape: the FA2 prefill kernel (the backends pin ``KERNEL_BACKEND = "fa2"``; prefill,
    chunked prefill, every cascade level and tensor-core decode use it) and, for GQA groups
    1/2/4, the CUDA-core decode kernel :class:`FlashInferAttention` picks there. Plus the
    cascade module (``merge_state``/``merge_state_in_place``). Index tensors are int32 and
    positional encoding off, what the backends plan; a sliding window (``window_left >= 0``)
    and a soft cap (``logits_soft_cap > 0``) are each a kernel switch of their own.
    """
    _set_build_env()
    import torch
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_primary_module,
        gen_batch_decode_module,
    )
    from flashinfer.jit.cascade import gen_cascade_module

    from radixkv.attention.flashinfer_backend import KERNEL_BACKEND, decode_uses_tensor_cores

    assert KERNEL_BACKEND == "fa2", (
        "the kit compiles FA2 kernels; FA3 needs gen_batch_prefill_module"
    )

    specs: dict[str, Any] = {}

    def add(spec: Any) -> None:
        specs.setdefault(spec.name, spec)

    add(gen_cascade_module())
    for dtype, hq, hkv, d, window, softcap in variants:
        base = (dtype, dtype, dtype, torch.int32, d, d, 0, window, softcap)
        prefill = (*base, False, False)  # no fp16 QK reduction, no token-head scales
        add(_gen_batch_prefill_primary_module(KERNEL_BACKEND, *prefill))
        if not decode_uses_tensor_cores(hq, hkv):
            add(gen_batch_decode_module(*base))
    return specs


def required_modules() -> list[str]:
    return sorted(required_specs(_check_module().kernel_variants()))


def load_kernels(variants: list[tuple[Any, int, int, int, bool, bool]]) -> list[Any]:
    """Ask flashinfer for every kernel of ``variants`` the way the wrappers' ``plan`` does
    (``get_batch_prefill_module`` / ``get_batch_decode_module`` / ``get_cascade_module``), so
    with the kit's kernels in place and JIT disabled this loads them or raises."""
    import torch
    from flashinfer.cascade import get_cascade_module
    from flashinfer.decode import get_batch_decode_module
    from flashinfer.prefill import get_batch_prefill_module

    from radixkv.attention.flashinfer_backend import KERNEL_BACKEND, decode_uses_tensor_cores

    mods = [get_cascade_module()]
    for dtype, hq, hkv, d, window, softcap in variants:
        base = (dtype, dtype, dtype, torch.int32, d, d, 0, window, softcap)
        mods.append(get_batch_prefill_module(KERNEL_BACKEND, *base, False, False))
        if not decode_uses_tensor_cores(hq, hkv):
            mods.append(get_batch_decode_module(*base))
    return mods


_DATA_FILES: list[str] | None = None


def runtime_data_files() -> list[str]:
    """The files under flashinfer's data/ that asking for the check's kernels reads (module
    generators render jinja templates and copy .cu files from data/csrc even when the kernel is
    then loaded ahead of time; the lazy independent-stride FA2 module is generated up front).
    Found by calling :func:`load_kernels` with loading stubbed out; memoised (flashinfer caches
    its getters, so a second call would read nothing)."""
    global _DATA_FILES
    if _DATA_FILES is None:
        from unittest import mock

        from flashinfer.jit.core import JitSpecNvcc

        def run() -> None:
            with mock.patch.object(JitSpecNvcc, "build_and_load", lambda self: mock.MagicMock()):
                load_kernels(_check_module().kernel_variants())

        _, _DATA_FILES = _record_data_reads(run)
    return _DATA_FILES


# ------------------------------------------------------------------------------------------------
# Building
def _runs_on_312(wheel: Path) -> bool:
    """A wheel the lent machine's CPython 3.12 installs: built for cp312, or for the stable ABI
    (``abi3``, from an older CPython on)."""
    return "-cp312-" in wheel.name or "-abi3-" in wheel.name


def _pip_download(dest: Path, requirement: str, *, target: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_")
    version = requirement.split("==")[1]
    found = [p for p in dest.glob(f"{name}-{version}-*.whl") if not target or _runs_on_312(p)]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    if target:
        cmd += ["--only-binary=:all:", "--implementation", "cp", "--python-version", TARGET_PYTHON]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
    subprocess.run([*cmd, requirement], check=True)
    found = [p for p in dest.glob(f"{name}-{version}-*.whl") if not target or _runs_on_312(p)]
    if not found:
        raise RuntimeError(f"pip download {requirement} left no wheel in {dest}")
    return found[0]


def _record_data_reads(fn: Any) -> tuple[Any, list[str]]:
    """Run ``fn``; also return the files it opened under flashinfer's ``data/`` folder (as
    wheel paths)."""
    import builtins

    import flashinfer

    data = Path(flashinfer.__file__).resolve().parent / "data"
    seen: set[str] = set()
    real_open = builtins.open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)):
            path = Path(file).resolve()
            if data in path.parents:
                seen.add("flashinfer/data/" + path.relative_to(data).as_posix())
        return real_open(file, *args, **kwargs)

    builtins.open = spy
    try:
        result = fn()
    finally:
        builtins.open = real_open
    return result, sorted(seen)


def _python_files_archive(wheel: Path, out: Path, data_files: list[str]) -> int:
    """flashinfer's *.py / *.json / py.typed, plus the ``data_files`` its generators read (not
    the rest of data/: CUDA sources, CUTLASS and CCCL headers), as tar.xz."""
    if out.exists() and out.stat().st_mtime > wheel.stat().st_mtime:
        with tarfile.open(out) as tar:
            names = set(tar.getnames())
        if set(data_files) <= names:
            return len(names)
    count = 0
    tmp = out.with_suffix(".tmp")
    wanted = set(data_files)
    with zipfile.ZipFile(wheel) as zf, tarfile.open(tmp, "w:xz", preset=6) as tar:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            name = info.filename
            if not name.startswith("flashinfer/"):
                continue
            if name.startswith("flashinfer/data/"):
                if name not in wanted:
                    continue
            elif not (name.endswith((".py", ".json")) or name.endswith("py.typed")):
                continue
            data = zf.read(info)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            tar.addfile(ti, io.BytesIO(data))
            count += 1
            wanted.discard(name)
    if wanted:
        raise RuntimeError(f"not in {wheel.name}: {sorted(wanted)}")
    tmp.replace(out)
    return count


def _stub_libcuda(folder: Path) -> Path:
    """An empty libcuda.so (soname libcuda.so.1) to link against: there is no driver here."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / "libcuda.so"
    if not lib.exists():
        src = folder / "empty.c"
        src.write_text("")
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
            check=True,
        )
    return folder


def _curand_headers(cuda_home: str) -> None:
    """FA3's CUTLASS headers include curand_kernel.h; a CUDA install without cuRAND (this
    machine's) gets the headers of the pinned nvidia-curand wheel through CPATH (a changed
    nvcc command line would make ninja rebuild every kernel; CPATH does not)."""
    if (Path(cuda_home) / "include" / "curand_kernel.h").exists():
        return
    inc = BUILD_DIR / "cuda-extra" / "nvidia" / "cu13" / "include"
    if not (inc / "curand_kernel.h").exists():
        wheel = _pip_download(
            BUILD_DIR / "wheels", f"nvidia-curand=={CURAND_VERSION}", target=False
        )
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("nvidia/cu13/include/"):
                    zf.extract(name, BUILD_DIR / "cuda-extra")
    os.environ["CPATH"] = os.pathsep.join(p for p in (str(inc), os.environ.get("CPATH")) if p)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(kit: Path, *, rebuild: bool = False) -> dict[str, Any]:
    _set_build_env()
    os.environ.setdefault("MAX_JOBS", "1")
    stub = _stub_libcuda(BUILD_DIR / "stub")
    extra = os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"{extra} -L{stub}".strip()
    _curand_headers(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    os.nice(19 - os.nice(0))  # compile at the lowest priority: the machine is shared

    import flashinfer
    import tvm_ffi

    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise SystemExit(
            f"flashinfer {flashinfer.__version__} is installed; the kit is for "
            f"{FLASHINFER_VERSION} (nox -s gpu_kit installs it)"
        )
    t_start = time.perf_counter()
    kit.mkdir(parents=True, exist_ok=True)
    old = _read_manifest(kit)
    old_modules = {m["name"]: m for m in old.get("modules", [])} if old else {}
    same_toolchain = (
        bool(old)
        and old.get("flashinfer") == FLASHINFER_VERSION
        and (old.get("cuda_arch") == CUDA_ARCH and old.get("tvm_ffi") == TVM_FFI_VERSION)
    )

    # 1. wheels
    wheels = BUILD_DIR / "wheels"
    fi_wheel = _pip_download(wheels, f"flashinfer-python=={FLASHINFER_VERSION}", target=False)
    tvm_wheel = _pip_download(wheels, f"apache-tvm-ffi=={TVM_FFI_VERSION}", target=True)
    carried = [tvm_wheel] + [_pip_download(wheels, r, target=True) for r in RUNTIME_WHEELS]
    for stale in kit.glob("*.whl"):
        if stale.name not in {w.name for w in carried}:
            stale.unlink()
    for wheel in carried:
        shutil.copy2(wheel, kit / wheel.name)
    # 2. kernels: the specs (and the data files their generators read), then compile
    specs = required_specs(_check_module().kernel_variants())
    data_files = runtime_data_files()
    n_py = _python_files_archive(fi_wheel, kit / "flashinfer-py.tar.xz", data_files)
    aot = kit / "aot"
    keep = set(specs)
    if aot.exists():
        for d in aot.iterdir():
            if d.name not in keep:
                shutil.rmtree(d)
    modules = []
    for name, spec in specs.items():
        dest = aot / name / f"{name}.so"
        prior = old_modules.get(name)
        if (
            not rebuild
            and same_toolchain
            and prior
            and dest.exists()
            and prior.get("sha256") == _sha256(dest)
        ):
            modules.append(prior)
            print(f"  {name}: up to date", flush=True)
            continue
        print(f"  {name}: compiling ({len(spec.sources)} sources) ...", flush=True)
        lib = Path(spec.jit_library_path)
        before = lib.stat().st_mtime if lib.exists() else None
        t0 = time.perf_counter()
        spec.build(verbose=False)
        secs = time.perf_counter() - t0
        reused = before is not None and lib.stat().st_mtime == before  # ninja: up to date
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest)
        entry = {"name": name, "bytes": dest.stat().st_size, "sha256": _sha256(dest)}
        entry["build_seconds"] = None if reused else round(secs, 1)
        if reused and prior and prior.get("build_seconds"):
            entry["build_seconds"] = prior["build_seconds"]
        modules.append(entry)
        how = "up to date in the build folder" if reused else f"{secs:.0f} s"
        print(f"  {name}: {how}, {dest.stat().st_size / 2**20:.1f} MiB", flush=True)

    # 3. runner and manifest
    run_sh = kit / "run.sh"
    run_sh.write_text(
        RUN_SH.format(fi_version=FLASHINFER_VERSION, arch=CUDA_ARCH, py=TARGET_PYTHON)
    )
    run_sh.chmod(0o755)
    manifest = {
        "flashinfer": FLASHINFER_VERSION,
        "tvm_ffi": TVM_FFI_VERSION,
        "tvm_ffi_built_with": getattr(tvm_ffi, "__version__", "?"),
        "cuda_arch": CUDA_ARCH,
        "nvcc": _nvcc_version(),
        "target_python": TARGET_PYTHON,
        "variants": [
            {
                "dtype": str(dt).removeprefix("torch."),
                "num_qo_heads": hq,
                "num_kv_heads": hkv,
                "head_dim": d,
                "sliding_window": window,
                "logits_soft_cap": softcap,
            }
            for dt, hq, hkv, d, window, softcap in _check_module().kernel_variants()
        ],
        "modules": sorted(modules, key=lambda m: m["name"]),
        "python_files": n_py,
        "data_files": data_files,
        # nvcc time of the kernels as last compiled (None where this build found one already
        # compiled in .gpu-kit-build/ and had no earlier record of its time)
        "kernel_build_seconds": round(sum(m["build_seconds"] or 0 for m in modules), 1),
        "this_build_seconds": round(time.perf_counter() - t_start, 1),
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    manifest["kit_bytes"] = _dir_bytes(kit)
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = manifest["kit_bytes"]
    print(
        f"gpu kit: {kit} {size / 2**20:.1f} MiB, {len(modules)} kernels "
        f"(compile time {manifest['kernel_build_seconds']:.0f} s in all)"
    )
    if size > KIT_LIMIT_BYTES:
        raise SystemExit(f"gpu kit is {size / 2**20:.1f} MiB, over the 60 MiB that can travel")
    return manifest


def _nvcc_version() -> str:
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    try:
        out = subprocess.run(
            [f"{cuda}/bin/nvcc", "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------
# Checking
def _read_manifest(kit: Path) -> dict[str, Any] | None:
    path = kit / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def check(kit: Path) -> list[str]:
    """Problems with the kit (empty when it covers the check): missing kernels, files, size."""
    problems: list[str] = []
    manifest = _read_manifest(kit)
    if manifest is None:
        return [f"{kit}/manifest.json missing: run `python bench/gpu_kit.py build`"]
    if manifest.get("flashinfer") != FLASHINFER_VERSION:
        problems.append(
            f"kit is for flashinfer {manifest.get('flashinfer')}, not {FLASHINFER_VERSION}"
        )
    if manifest.get("cuda_arch") != CUDA_ARCH:
        problems.append(f"kit kernels are for {manifest.get('cuda_arch')}, not {CUDA_ARCH}")
    have = {m["name"]: m for m in manifest.get("modules", [])}
    for name in required_modules():
        if name not in have:
            problems.append(f"kernel {name} is not in the kit")
            continue
        so = kit / "aot" / name / f"{name}.so"
        if not so.exists():
            problems.append(f"{so} missing")
        elif _sha256(so) != have[name]["sha256"]:
            problems.append(f"{so} differs from the manifest")
    for path in ("run.sh", "flashinfer-py.tar.xz"):
        if not (kit / path).exists():
            problems.append(f"{kit / path} missing")
    if (kit / "flashinfer-py.tar.xz").exists():
        data_files = runtime_data_files()
        with tarfile.open(kit / "flashinfer-py.tar.xz") as tar:
            names = set(tar.getnames())
        for name in data_files:
            if name not in names:
                problems.append(f"{name} (read when the kernel is asked for) is not in the kit")
    if not list(kit.glob(f"apache_tvm_ffi-{TVM_FFI_VERSION}-cp312-*.whl")):
        problems.append("the cp312 apache-tvm-ffi wheel is missing")
    for req in RUNTIME_WHEELS:
        name, version = req.replace("-", "_").split("==")
        if not [w for w in kit.glob(f"{name}-{version}-*.whl") if _runs_on_312(w)]:
            problems.append(f"the cp312 {req} wheel is missing")
    size = _dir_bytes(kit)
    if size > KIT_LIMIT_BYTES:
        problems.append(f"kit is {size / 2**20:.1f} MiB, over 60 MiB")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=("build", "check", "modules"))
    ap.add_argument("--kit", type=Path, default=KIT_DIR)
    ap.add_argument("--rebuild", action="store_true", help="compile every kernel again")
    args = ap.parse_args()
    if args.action == "modules":
        print("\n".join(required_modules()))
        return 0
    if args.action == "build":
        build(args.kit, rebuild=args.rebuild)
    problems = check(args.kit)
    for p in problems:
        print(f"gpu kit: {p}")
    if not problems:
        print(f"gpu kit: manifest covers all {len(required_modules())} kernels the check needs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
