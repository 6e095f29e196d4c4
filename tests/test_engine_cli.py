"""The ``radixkv`` command line: demo (small), generate, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.cli import main


def test_demo_small_prints_table_and_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "demo.json"
    rc = main(
        [
            "demo",
            "--requests",
            "6",
            "--system-words",
            "40",
            "--max-tokens",
            "2",
            "--num-pages",
            "256",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "TTFT" in out and "cache tree" in out and "root" in out
    assert "float32, torch threads=" in out  # the demo says which dtype it ran
    off, on = json.loads(out_json.read_text())
    assert off["cache"] is False and on["cache"] is True
    assert off["prefill_saved"] == 0 and on["prefill_saved"] > 0
    assert on["prefill_computed"] + on["prefill_saved"] == off["prefill_computed"]


def test_generate_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-tokens", "3", "--stream", "--temperature", "0.7"]) == 0
    assert main(["generate", "", "--max-tokens", "3"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-tokens", "3", "--repetition-penalty", "1.5"]) == 0
    assert main(["generate", "hi", "--max-tokens", "3", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no-such-command"])
