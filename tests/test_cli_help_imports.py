"""The command line's help and flag parsing import no torch (nor FastAPI): ``radixkv serve --help``
answers at once. Each check runs in a fresh interpreter, since this one has torch loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "fastapi", "uvicorn", "safetensors", "tokenizers")


def _run_without_heavy_imports(body: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, contextlib, io\n"
        f"{body}\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, f'imported {loaded}'\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "argv",
    [["serve", "--help"], ["serve-ray", "--help"], ["--help"], ["generate", "--help"]],
    ids=" ".join,
)
def test_help_imports_no_torch(argv: list[str]) -> None:
    """What ``radixkv <argv>`` (and ``python -m radixkv``, the same main) imports."""
    proc = _run_without_heavy_imports(
        "from radixkv.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        "assert 'usage: radixkv' in out.getvalue(), out.getvalue()\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_serve_flags_and_engine_config_import_no_torch() -> None:
    """Parsing ``serve`` flags into an EngineConfig (its choices and checks) needs no torch."""
    proc = _run_without_heavy_imports(
        "import argparse\n"
        "from radixkv.engine.config import EngineConfig\n"
        "from radixkv.server.cli import add_serve_arguments\n"
        "p = add_serve_arguments(argparse.ArgumentParser())\n"
        "args = p.parse_args(['--attention-backend', 'torch', '--schedule-policy', 'fcfs',\n"
        "                     '--kv-cache-dtype', 'fp8', '--cascade', 'off'])\n"
        "cfg = EngineConfig.from_cli_args(args)\n"
        "assert (cfg.attention_backend, cfg.schedule_policy) == ('torch', 'fcfs')\n"
        "try:\n"
        "    EngineConfig(attention_backend='nope')\n"
        "except ValueError as e:\n"
        "    assert 'flashinfer' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_a_heavy_import_is_caught() -> None:
    """The check itself fails when torch is imported (so a pass above means something)."""
    proc = _run_without_heavy_imports("import torch")
    assert proc.returncode != 0
    assert "imported ['torch']" in proc.stderr
