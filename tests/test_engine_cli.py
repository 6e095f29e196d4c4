"""The ``radixkv`` command line: demo (small), generate, errors."""

from __future__ import annotations

import json
import re
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


def test_generate_with_lora(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--lora runs the prompt with an adapter folder (greedy: another continuation than the
    base model's); a folder that is not an adapter exits 2 naming the missing file."""
    from radixkv.model.lora import save_random_adapter
    from radixkv.model.tiny import tiny_config

    folder = save_random_adapter(tiny_config(), tmp_path / "ad", seed=0, rank=4, scale=3.0)
    args = ["generate", "def read(path):\n", "--max-tokens", "12"]
    assert main(args) == 0
    base = capsys.readouterr().out
    assert main([*args, "--lora", str(folder)]) == 0
    adapted = capsys.readouterr().out
    assert adapted != base
    assert main([*args, "--lora", str(folder), "--stream"]) == 0
    assert capsys.readouterr().out == adapted
    assert main([*args, "--lora", str(tmp_path)]) == 2
    assert "adapter_config.json: file is missing" in capsys.readouterr().err


def test_generate_guided(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--json-schema (inline or @file), --json-object, --regex and --choice constrain the
    output; a bad regex or an unreadable schema file exits 2 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for flag in (json.dumps(schema), f"@{path}"):
        assert main(["generate", "Count: ", "--json-schema", flag, "--max-tokens", "40"]) == 0
        value = json.loads(capsys.readouterr().out)
        assert isinstance(value["n"], int)
    assert main(["generate", "x", "--json-object", "--max-tokens", "200"]) == 0
    out = capsys.readouterr()
    if "finish=stop" in out.err:
        assert isinstance(json.loads(out.out), dict)
    assert main(["generate", "x", "--regex", "[0-9]{2}-[a-z]{2}"]) == 0
    assert re.fullmatch(r"[0-9]{2}-[a-z]{2}", capsys.readouterr().out.strip())
    assert main(["generate", "x", "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(["generate", "x", "--regex", "(unclosed"]) == 2
    assert "guided decoding cannot use regex" in capsys.readouterr().err
    assert main(["generate", "x", "--json-schema", f"@{tmp_path / 'missing.json'}"]) == 2
    assert "--json-schema: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--regex", "a", "--choice", "a"])  # one constraint at most
