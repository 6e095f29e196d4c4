"""``radixkv bench``: the engine benchmark command (small workloads), its report and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixkv.cli import main


def _bench(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    assert main(["bench", "--no-progress", "--json", str(out), *flags]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_generated_shared_prefix_cache_off_then_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    groups, per_group, system, question = 2, 3, 64, 16
    report = _bench(
        tmp_path,
        *("--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group)),
        *("--gsp-system-prompt-len", str(system), "--gsp-question-len", str(question)),
        *("--gsp-output-len", "3", "--num-pages", "256"),
    )
    out = capsys.readouterr().out
    n = groups * per_group
    work = report["workload"]
    assert work["dataset"] == "generated-shared-prefix" and work["requests"] == n
    assert work["prompt_tokens"] == n * (system + question)
    # every prompt past the first of its group could reuse the group's system prompt
    assert work["ideal_hit_rate"] == pytest.approx(
        (n - groups) * system / (n * (system + question))
    )
    off, on = report["results"]
    assert (off["cache"], on["cache"]) == (False, True)
    assert off["prefill_saved"] == 0 and off["prefill_computed"] == work["prompt_tokens"]
    assert 0 < on["prefill_saved"] <= (n - groups) * system
    assert on["prefill_computed"] + on["prefill_saved"] == work["prompt_tokens"]
    assert on["output_tokens"] == off["output_tokens"] == n * 3  # ignore_eos: every token
    assert on["hit_rate"] <= work["ideal_hit_rate"] + 1e-9
    assert report["summary"]["hit_rate"] == on["hit_rate"]
    assert report["engine"]["page_size"] == 16 and report["engine"]["enable_prefix_cache"]
    # the printed report: header, table, ratios
    assert "radixkv bench: generated-shared-prefix" in out and "perfect cache" in out
    assert "TTFT mean" in out and "prefix cache: time to first token" in out
    assert "model radixkv-tiny in float32" in out


def test_branches_decode_with_the_cascade(tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        *("--dataset-name", "branches", "--num-prompts", "4", "--branches-prefix-len", "256"),
        *("--branches-unique-len", "4", "--branches-output-len", "4"),
        *("--cache", "on", "--cascade", "on"),
    )
    (on,) = report["results"]
    assert on["cache"] is True and report["summary"] == {}  # one side: no ratios
    assert on["prefill_saved"] == 3 * 256  # the trunk, computed once
    assert on["cascade_steps"] > 0
    assert on["decode_kv_bytes_read"] < on["decode_kv_bytes_plain"]
    assert any("cascade in" in line for line in report["summary_lines"])


def test_random_prompts_get_no_hits_and_the_warmup_is_forgotten(tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        *("--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "48"),
        *("--random-output-len", "2", "--cache", "on"),
    )
    (on,) = report["results"]
    assert report["workload"]["ideal_hit_rate"] == 0.0
    assert on["prefill_saved"] == 0 and on["prefill_computed"] == 3 * 48


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gsp-num-groups", "0"], "expected a positive integer, got 0"),
        (["--random-input-len", "x"], "expected a positive integer, got 'x'"),
        (["--cache", "on", "--disable-prefix-cache"], "contradict each other"),
        (["--dataset-name", "random", "--random-input-len", "20000"], "model's context is"),
        (["--model", "/no/such/model"], "not a model folder"),
        (["--page-size", "0"], "page_size must be"),
    ],
)
def test_bad_settings_exit_2_naming_the_problem(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--no-progress", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- --base-url: a running server
def test_base_url_drives_a_live_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from server_helpers import assert_clean, live_server

    groups, per_group, system, question, out_len = 2, 3, 64, 16, 4
    flags = [
        *("--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group)),
        *("--gsp-system-prompt-len", str(system), "--gsp-question-len", str(question)),
        *("--gsp-output-len", str(out_len), "--max-concurrency", "3"),
    ]
    with live_server() as (srv, st):
        first = _bench(tmp_path, "--base-url", srv.url, *flags)
        again = _bench(tmp_path, "--base-url", srv.url, *flags)
        assert_clean(st)  # every request ended, locks back to zero, pages conserved
    n = groups * per_group
    (server,) = first["servers"]
    s = server["summary"]
    assert server["model"] == "radixkv-tiny"  # the first model /v1/models lists
    assert (s["completed"], s["failed"], s["first_error"]) == (n, 0, None)
    assert s["prompt_tokens"] == n * (system + question)
    assert s["output_tokens"] == n * out_len  # ignore_eos: every request its max_tokens
    assert s["short_outputs"] == 0
    # the server served each group's system prompt from its cache to the group's later prompts
    assert 0 < s["cached_tokens"] <= (n - groups) * system
    assert s["ttft_ms"]["mean"] > 0 and s["latency_ms"]["p99"] >= s["ttft_ms"]["p99"]
    # the same seed again: the server still holds the first run's prompts
    assert again["servers"][0]["summary"]["cached_share"] > s["cached_share"]
    out = capsys.readouterr().out
    assert "server prefix cache:" in out and "time to first token" in out


def test_base_url_failures_are_counted_and_reported(tmp_path: Path) -> None:
    from server_helpers import live_server

    out = tmp_path / "fail.json"
    with live_server(max_model_len=128) as (srv, _):
        # extra body fields reach the server: an invalid one fails every request
        small = ["--dataset-name", "random", "--num-prompts", "1", "--random-input-len", "16"]
        small += ["--random-output-len", "2", "--base-url", srv.url]
        assert main(["bench", *small]) == 0
        assert main(["bench", *small, "--extra-request-body", '{"top_k": -5}']) == 1
        flags = ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "200"]
        rc = main(["bench", "--base-url", srv.url, "--json", str(out), *flags])
    assert rc == 1  # some request failed
    report = json.loads(out.read_text())
    s = report["servers"][0]["summary"]
    assert (s["completed"], s["failed"], report["failed_requests"]) == (0, 2, 2)
    assert "HTTP 400" in s["first_error"] and "context length" in s["first_error"]


def test_two_servers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from server_helpers import live_server

    flags = [
        *("--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-output-len", "2"),
        *("--gsp-system-prompt-len", "64", "--gsp-question-len", "16", "--repeats", "2"),
    ]
    with live_server() as (on, _), live_server(enable_prefix_cache=False) as (off, _):
        report = _bench(tmp_path, "--base-url", on.url, "--base-url", off.url, *flags)
    cached, plain = report["servers"]
    assert (cached["base_url"], plain["base_url"]) == (on.url, off.url)
    for server in report["servers"]:
        assert server["summary"]["completed"] == 2 * 6  # both rounds
        assert server["summary"]["prompt_tokens"] == 2 * 6 * 80
    # round 2 sends new prompts: the cache serves what a fresh one would, no more
    ideal = report["workload"]["ideal_hit_rate"]
    assert 0 < cached["summary"]["cached_share"] <= ideal + 1e-9
    assert plain["summary"]["cached_share"] == 0
    out = capsys.readouterr().out
    table = out[out.index("server ") :]
    assert on.url in table and off.url in table and "TTFT mean" in table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
        (["--base-url", "http://127.0.0.1:9", "--repeats", "0"], "--repeats must be >= 1"),
        (["--base-url", "http://127.0.0.1:9", "--cache", "on"], "--cache applies to an engine"),
        (["--base-url", "http://x", "--request-rate", "0"], "expected a rate > 0"),
        (["--base-url", "http://x", "--extra-request-body", "{x"], "not JSON"),
        (["--base-url", "http://x", "--extra-request-body", "[1]"], "expected a JSON object"),
    ],
)
def test_base_url_bad_settings_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _stream_of(*events: str) -> Any:
    """An httpx transport answering every completion with these SSE events."""
    import httpx

    def handler(request: Any) -> Any:
        body = "".join(f"data: {e}\n\n" for e in events)
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("events", "ok", "error"),
    [
        (['{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}', "[DONE]"], True, None),
        (['{"choices":[{"text":"a"}]}', '{"error":{"message":"engine failed"}}'], False, "failed"),
        (['{"choices":[{"text":"a","finish_reason":"error"}]}', "[DONE]"], False, "'error'"),
        (['{"choices":[{"text":""}]}', "[DONE]"], False, "without any text"),
    ],
)
def test_a_stream_counts_only_when_it_delivers(
    events: list[str], ok: bool, error: str | None
) -> None:
    import asyncio

    import httpx

    from radixkv.bench.serving import _one

    async def go() -> Any:
        transport = _stream_of(*events)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await _one(client, "m", [1, 2, 3], 4)

    rec = asyncio.run(go())
    assert rec.ok is ok
    if error is None:
        assert rec.error is None and rec.output_tokens == 2 and len(rec.itl) == 1
    else:
        assert error in (rec.error or "")


def test_an_openai_style_base_url_ending_in_v1_works(tmp_path: Path) -> None:
    from server_helpers import live_server

    flags = ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "32"]
    with live_server() as (srv, _):
        report = _bench(
            tmp_path, "--base-url", srv.url + "/v1/", *flags, "--random-output-len", "2"
        )
    (server,) = report["servers"]
    assert server["base_url"] == srv.url and server["summary"]["completed"] == 2


def test_text_prompts_for_servers_that_take_text_only(tmp_path: Path) -> None:
    from server_helpers import live_server

    from radixkv.bench.serving import _WORDS, as_text

    assert len(set(_WORDS)) == len(_WORDS) == 256  # one distinct word per token id below 256
    texts = as_text([[0, 1, 2], [0, 1, 3]])
    assert texts[0] != texts[1] and texts[0][:9] == texts[1][:9]  # shared ids, shared text
    flags = [
        *("--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-output-len", "2"),
        *("--gsp-system-prompt-len", "32", "--gsp-question-len", "8", "--prompt-format", "text"),
    ]
    with live_server() as (srv, _):
        report = _bench(tmp_path, "--base-url", srv.url, *flags)
    s = report["servers"][0]["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["prompt_tokens"] > 6 * 40  # the server's count: radixkv-tiny reads bytes
    assert s["cached_tokens"] > 0  # the groups' shared text is served from the cache


def test_outputs_that_stop_short_are_counted() -> None:
    from radixkv.bench.serving import RequestRecord, _server_lines, summarize

    recs = [
        RequestRecord(ok=True, prompt_tokens=5, output_tokens=n, ttft=0.1, latency=0.2)
        for n in (4, 4, 1)
    ] + [RequestRecord(ok=False, error="HTTP 500: x")]
    s = summarize(recs, 1.0, output_len=4)
    assert (s["completed"], s["failed"], s["short_outputs"], s["output_tokens"]) == (3, 1, 1, 9)
    lines = _server_lines(s, 0.5)
    assert any("1 of 3 outputs stopped before max_tokens" in line for line in lines)
    assert lines[-1] == "first failure: HTTP 500: x"


def test_multi_turn_chats_resent_with_their_history(tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        *("--dataset-name", "multi-turn", "--mt-conversations", "3", "--mt-turns", "3"),
        *("--mt-system-len", "64", "--mt-user-len", "16", "--mt-assistant-len", "32"),
        *("--mt-output-len", "2", "--cache", "on"),
    )
    work = report["workload"]
    # turns of 80, 128 and 176 tokens; reusable: the system prompt for chats 2 and 3's first
    # turns, then each turn's predecessor (80 and 128 tokens)
    assert work["requests"] == 9 and work["prompt_tokens"] == 3 * (80 + 128 + 176)
    assert work["ideal_hit_rate"] == pytest.approx((2 * 64 + 3 * (80 + 128)) / (3 * 384))
    (on,) = report["results"]
    assert 0 < on["prefill_saved"] <= work["ideal_hit_rate"] * work["prompt_tokens"]


def test_no_library_module_imports_the_bench_tooling() -> None:
    """radixkv/bench/ is the command line's tooling: only cli.py and radixkv/bench/ itself
    import it, so the library layers (cache ... server, cluster) carry no benchmark code."""
    import ast

    import radixkv

    root = Path(radixkv.__file__).resolve().parent
    reaching = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel == "cli.py" or rel.startswith("bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(n == "radixkv.bench" or n.startswith("radixkv.bench.") for n in names):
                reaching.append(rel)
    assert reaching == []
    assert (root / "bench" / "offline.py").is_file()  # the walk saw the package
