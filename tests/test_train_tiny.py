"""tools/train_tiny.py: builds its corpus deterministically and trains reproducibly (a few steps
on a small stand-in for the standard library; the shipped run is the same code with more steps)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "tools" / "train_tiny.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for i in range(45):
        sub = root / ("pkg" if i % 3 else "") / ("test" if i == 7 else "")
        sub.mkdir(parents=True, exist_ok=True)
        body = "".join(f"    x{j} = {i} * {j}\n" for j in range(i % 7 + 3))
        (sub / f"mod{i:02d}.py").write_text(f'def f{i}(a, b):\n    """Sum {i}."""\n{body}')
    (root / "encodings").mkdir()
    (root / "encodings" / "cp1.py").write_text("table = 1\n")
    (root / "_sysconfigdata_x.py").write_text("build = {}\n")
    return root


def test_corpus_is_sorted_filtered_and_hashed(stdlib: Path) -> None:
    tt = _script()
    files = [p.as_posix() for p in tt.corpus_files(stdlib)]
    assert files == sorted(files) and len(files) == 44  # minus test/, encodings/, _sysconfigdata
    assert not any("test/" in f or "encodings" in f or "sysconfig" in f for f in files)
    a, b = tt.build_corpus(stdlib), tt.build_corpus(stdlib)
    assert a["sha256"] == b["sha256"] and torch.equal(a["train"], b["train"])
    assert a["val_files"] == 1 and a["train_files"] == 43
    assert int(a["train"][0]) == tt.BOS and tt.EOS in a["train"].tolist()


def test_training_is_reproducible(stdlib: Path, tmp_path: Path) -> None:
    tt = _script()
    common = ["--stdlib", str(stdlib), "--steps", "3", "--batch", "2", "--seq-len", "32"]
    common += ["--warmup", "1", "--eval-windows", "2", "--eval-every", "3", "--threads", "1"]
    for run in ("a", "b"):
        assert tt.main([*common, "--out", str(tmp_path / run)]) == 0
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "radixkv-tiny.safetensors"))
    wb = load_file(str(tmp_path / "b" / "radixkv-tiny.safetensors"))
    sa = json.loads((tmp_path / "a" / "radixkv-tiny.json").read_text())
    sb = json.loads((tmp_path / "b" / "radixkv-tiny.json").read_text())
    assert sa["loss_at"] == sb["loss_at"] and sa["held_out"] == sb["held_out"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa["steps_run"] == 3 and sa["corpus"]["train_files"] == 43
    with pytest.raises(SystemExit):  # a cut-short run must not overwrite the packaged weights
        tt.main([*common, "--stop-after", "1"])
