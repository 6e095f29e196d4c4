"""Request decoding/validation, auth and tenant namespaces, metrics registries, config (no engine)."""

from __future__ import annotations

import json

import pytest
from server_helpers import metric_values

from radixkv.server import protocol as P
from radixkv.server.auth import ANONYMOUS, Authenticator, load_api_keys
from radixkv.server.config import ServerConfig
from radixkv.server.errors import APIError
from radixkv.server.metrics import ServerMetrics


def _cmpl(**kw: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **kw}).encode()


def test_completion_defaults_and_prompt_shapes() -> None:
    r = P.decode_request(_cmpl(), P.CompletionRequest)
    assert r.max_tokens == 16 and r.n == 1 and r.temperature == 1.0 and not r.stream
    assert r.prompts() == ["hi"]
    assert P.decode_request(_cmpl(prompt=[1, 2]), P.CompletionRequest).prompts() == [[1, 2]]
    assert P.decode_request(_cmpl(prompt=["a", "b"]), P.CompletionRequest).prompts() == ["a", "b"]
    assert P.decode_request(_cmpl(prompt=[[1], [2, 3]]), P.CompletionRequest).prompts() == [
        [1],
        [2, 3],
    ]
    r = P.decode_request(
        _cmpl(stop="x", stream=True, stream_options={"include_usage": True}), P.CompletionRequest
    )
    assert (
        P.stop_list(r.stop) == ["x"]
        and r.stream_options is not None
        and r.stream_options.include_usage
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[]", None),
        (_cmpl(max_tokens="5"), "max_tokens"),
        (_cmpl(max_tokens=0), "max_tokens"),  # 0 only with echo
        (_cmpl(max_tokens=0, echo=True, min_tokens=1), "min_tokens"),
        (_cmpl(max_tokens=-1, echo=True), "max_tokens"),
        (_cmpl(max_tokens=1.5), "max_tokens"),
        (_cmpl(temperature=-0.1), None),
        (_cmpl(temperature=2.5), None),
        (_cmpl(top_p=0), None),
        (_cmpl(top_p=1.01), None),
        (_cmpl(n=0), None),
        (_cmpl(n=P.MAX_N + 1), None),
        (_cmpl(stop=[""]), None),
        (_cmpl(stop=["a"] * (P.MAX_STOP_STRINGS + 1)), None),
        (_cmpl(stop=5), "stop"),
        (_cmpl(prompt=""), None),
        (_cmpl(prompt=[]), None),
        (_cmpl(prompt=[1, "a"]), None),
        (_cmpl(prompt=[-1]), None),
        (_cmpl(prompt=None), "prompt"),
        (_cmpl(stream="yes"), "stream"),
        (_cmpl(stream_options={"include_usage": True}), None),  # without stream
        (
            _cmpl(stream=True, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage",
        ),
        (_cmpl(echo="yes"), "echo"),
        (_cmpl(suffix="x"), "suffix"),
        (_cmpl(suffix="x", echo=True), "suffix"),
        (_cmpl(prompt_logprobs=-1), "prompt_logprobs"),
        (_cmpl(prompt_logprobs=P.MAX_LOGPROBS + 1), "prompt_logprobs"),
        (_cmpl(prompt_logprobs=True), "prompt_logprobs"),
        (_cmpl(prompt_logprobs="2"), "prompt_logprobs"),
        (_cmpl(prompt_logprobs=1.5), "prompt_logprobs"),
        (_cmpl(prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (_cmpl(logprobs=P.MAX_LOGPROBS + 1), "logprobs"),
        (_cmpl(logprobs=-1), "logprobs"),
        (_cmpl(logprobs=True), "logprobs"),
        (_cmpl(presence_penalty=2.5), "presence_penalty"),
        (_cmpl(frequency_penalty=-3), "frequency_penalty"),
        (_cmpl(repetition_penalty=0), "repetition_penalty"),
        (_cmpl(repetition_penalty=P.MAX_REPETITION_PENALTY + 1), "repetition_penalty"),
        (_cmpl(repetition_penalty="high"), "repetition_penalty"),
        (_cmpl(response_format={"type": "grammar"}), "response_format"),
        (_cmpl(response_format={"type": "json_schema"}), "response_format"),
        (
            _cmpl(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format",
        ),
        (_cmpl(guided_json={"type": "object"}, guided_regex="a"), "guided_json"),
        (_cmpl(guided_choice=[]), "guided_choice"),
        (_cmpl(guided_choice=["a", ""]), "guided_choice"),
        (_cmpl(guided_json="not json"), "guided_json"),
        (_cmpl(guided_json=[1]), "guided_json"),
        (_cmpl(guided_grammar=""), "guided_grammar"),
        (_cmpl(guided_grammar='start: "a"', guided_regex="a"), "guided_regex"),
        (
            _cmpl(guided_grammar='start: "a"', guided_whitespace_pattern=" "),
            "guided_whitespace_pattern",
        ),
        (_cmpl(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
        (_cmpl(guided_regex="a", guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
        (_cmpl(structured_outputs={}), "structured_outputs"),
        (_cmpl(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (_cmpl(structured_outputs={"grammar": ""}), "structured_outputs"),
        (_cmpl(structured_outputs={"grammar": 'start: "a"', "regex": "a"}), "structured_outputs"),
        (_cmpl(structured_outputs={"regex": "a", "whitespace_pattern": " "}), "structured_outputs"),
        (_cmpl(structured_outputs={"json_object": True}, guided_regex="a"), "guided_regex"),
        (
            _cmpl(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "response_format",
        ),
        (_cmpl(prompt_logprobs_start=-1), "prompt_logprobs_start"),
        (_cmpl(prompt_logprobs_start="2"), "prompt_logprobs_start"),
        (_cmpl(prompt_logprobs_start=2), "prompt_logprobs_start"),  # no prompt logprobs
        (_cmpl(prompt_logprobs_start=2, echo=True), "prompt_logprobs_start"),  # echo alone
        (_cmpl(response_format={"type": 3}), "response_format.type"),
        (_cmpl(logit_bias={"x5": 10}), "logit_bias"),
        (_cmpl(logit_bias={"\u00b2": 1}), "logit_bias"),  # a digit to str.isdigit, not int()
        (_cmpl(logit_bias={"9" * 5000: 1}), "logit_bias"),
        (_cmpl(logit_bias={"5": 101}), "logit_bias"),
        (_cmpl(min_tokens=-1), "min_tokens"),
        (_cmpl(best_of=2), "best_of"),
        (_cmpl(use_beam_search=True, n=3, best_of=2), "best_of"),
        (_cmpl(length_penalty=2.0), "length_penalty"),  # without use_beam_search
        (_cmpl(early_stopping=True), "early_stopping"),
        (_cmpl(use_beam_search=True, early_stopping="sometimes"), "early_stopping"),
        (_cmpl(use_beam_search=True, length_penalty=11), "length_penalty"),
        (_cmpl(min_p=1.5), "min_p"),
        (_cmpl(temperature=None, top_p=None, model=None), "model"),
        (_cmpl(seed=2**70), None),
        (_cmpl(seed=-1), None),
        (_cmpl(cache_salt=""), None),
        (json.dumps({"prompt": "x"}).encode(), "model"),
    ],
)
def test_completion_rejects(body: bytes, param: str | None) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(body, P.CompletionRequest)
    assert e.value.message
    if param is not None:
        assert e.value.param == param


def _chat(**kw: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    ).encode()


def test_chat_decoding() -> None:
    r = P.decode_request(_chat(), P.ChatCompletionRequest)
    assert r.max_tokens is None
    assert r.template_messages() == [{"role": "user", "content": "hi"}]
    parts = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        }
    ]
    r = P.decode_request(_chat(messages=parts, max_completion_tokens=7), P.ChatCompletionRequest)
    assert r.max_tokens == 7
    assert r.template_messages() == [{"role": "system", "content": "ab"}]


@pytest.mark.parametrize(
    "body",
    [
        _chat(messages=[]),
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]),
        _chat(messages="hi"),
        _chat(max_tokens=3, max_completion_tokens=4),
        _chat(max_completion_tokens=0),
        _chat(top_logprobs=2),  # needs logprobs=true
        _chat(logprobs=True, top_logprobs=P.MAX_LOGPROBS + 1),
        _chat(logprobs=2),
        _chat(messages=[{"role": None, "content": "x"}]),
        _chat(max_tokens=0),  # echo (and so max_tokens=0) is completions' only
        _chat(prompt_logprobs=-1),
        _chat(prompt_logprobs=P.MAX_LOGPROBS + 1),
        _chat(prompt_logprobs=False),
        _chat(prompt_logprobs=2, stream=True),
    ],
)
def test_chat_rejects(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_request(body, P.ChatCompletionRequest)


def test_echo_and_prompt_logprobs_decoding() -> None:
    """What the engine is asked for: max_tokens=0 with echo runs one token; echo's logprobs and
    prompt_logprobs share one engine computation, sized for the larger."""
    r = P.decode_request(_cmpl(echo=True, max_tokens=0, logprobs=1), P.CompletionRequest)
    assert (r.max_tokens, r.engine_max_tokens(), r.engine_logprobs()) == (0, 1, 1)
    assert (r.echo_logprobs(), r.engine_prompt_logprobs()) == (1, 1)
    r = P.decode_request(_cmpl(echo=True, max_tokens=5), P.CompletionRequest)
    assert (r.engine_max_tokens(), r.echo_logprobs(), r.engine_prompt_logprobs()) == (5, None, None)
    r = P.decode_request(_cmpl(echo=True, logprobs=0, prompt_logprobs=3), P.CompletionRequest)
    assert (r.echo_logprobs(), r.engine_prompt_logprobs()) == (0, 3)
    r = P.decode_request(_cmpl(echo=True, logprobs=4, prompt_logprobs=2), P.CompletionRequest)
    assert r.engine_prompt_logprobs() == 4
    r = P.decode_request(_cmpl(logprobs=4, prompt_logprobs=0), P.CompletionRequest)
    assert (r.echo_logprobs(), r.engine_prompt_logprobs()) == (None, 0)
    r = P.decode_request(_cmpl(logprobs=4), P.CompletionRequest)
    assert r.engine_prompt_logprobs() is None
    r = P.decode_request(_chat(prompt_logprobs=0), P.ChatCompletionRequest)
    assert r.engine_prompt_logprobs() == 0 and r.engine_logprobs() is None
    # lm-eval-harness's local-completions request, as it sends it
    body = json.dumps(
        {
            "model": "m",
            "prompt": [[5, 6, 7], [8, 9]],
            "max_tokens": 1,
            "logprobs": 1,
            "echo": True,
            "temperature": 0,
            "seed": 1234,
        }
    ).encode()
    r = P.decode_request(body, P.CompletionRequest, strict=True)
    assert r.prompts() == [[5, 6, 7], [8, 9]] and r.engine_prompt_logprobs() == 1


def test_nulls_and_neutral_values_are_accepted() -> None:
    """What real clients send: null for "not given", neutral values of unsupported features."""
    nulls = {
        f: None for f in P.ChatCompletionRequest.__struct_fields__ if f not in ("model", "messages")
    }
    r = P.decode_request(_chat(**nulls), P.ChatCompletionRequest)
    assert (r.temperature, r.top_p, r.n, r.stream, r.max_tokens) == (1.0, 1.0, 1, False, None)
    assert r.engine_logprobs() is None
    r = P.decode_request(
        _chat(
            logprobs=False,
            top_logprobs=0,
            response_format={"type": "text"},
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            min_p=0,
            messages=[{"role": "user", "content": "hi", "name": None}],
        ),
        P.ChatCompletionRequest,
    )
    assert r.engine_logprobs() is None and r.min_p == 0.0
    r = P.decode_request(_chat(logprobs=True, top_logprobs=3), P.ChatCompletionRequest)
    assert r.engine_logprobs() == 3
    assert P.decode_request(_chat(logprobs=True), P.ChatCompletionRequest).engine_logprobs() == 0
    nulls = {f: None for f in P.CompletionRequest.__struct_fields__ if f not in ("model", "prompt")}
    r = P.decode_request(_cmpl(**nulls), P.CompletionRequest)
    assert r.max_tokens == 16 and r.engine_logprobs() is None
    r = P.decode_request(_cmpl(logprobs=0, echo=False, best_of=1, min_p=0.1), P.CompletionRequest)
    assert r.engine_logprobs() == 0 and r.min_p == 0.1


def test_unknown_fields_ignored_or_rejected_when_strict() -> None:
    body = _chat(
        foo=1,
        parallel_tool_calls=False,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False},
        messages=[{"role": "assistant", "content": "a", "refusal": None, "tool_calls": []}],
    )
    ignored: list[str] = []
    r = P.decode_request(body, P.ChatCompletionRequest, ignored=ignored)
    assert r.stream_options is not None and r.stream_options.include_usage
    assert sorted(ignored) == [  # tool_calls and parallel_tool_calls are fields now
        "foo",
        "messages[].refusal",
        "stream_options.continuous_usage_stats",
    ]
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(body, P.ChatCompletionRequest, strict=True)
    assert e.value.param in ignored and "unknown field" in e.value.message.lower()
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(_cmpl(foo=1), P.CompletionRequest, strict=True)
    assert e.value.param == "foo"
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(
            _cmpl(stream=True, stream_options={"bogus": 1}), P.CompletionRequest, strict=True
        )
    assert e.value.param == "stream_options.bogus"
    # strict mode still accepts nulls and neutral values
    P.decode_request(
        _cmpl(temperature=None, logprobs=None, echo=False), P.CompletionRequest, strict=True
    )


def test_usage_shape() -> None:
    u = P.make_usage(10, 3, 8)
    assert json.loads(P.encode(u)) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_auth_and_namespaces(tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-aaaaaaaa": "alice", "key-bbbbbbbb": "bob"}))
    auth = Authenticator(load_api_keys(keys), admin_key="admin-secret")
    a = auth.authenticate("Bearer key-aaaaaaaa")
    b = auth.authenticate("bearer key-bbbbbbbb")
    assert (a.tenant, b.tenant) == ("alice", "bob")
    for bad in (
        None,
        "",
        "Bearer",
        "Basic key-aaaaaaaa",
        "Bearer nope-nope-nope",
        "Bearer admin-secret",
    ):
        with pytest.raises(APIError) as e:
            auth.authenticate(bad)
        assert e.value.status == 401
    # the namespace comes from the tenant; a salt narrows within it and can never reach another tenant
    assert a.namespace(None) == ("alice",)
    assert a.namespace("s") == ("alice", "s")
    assert b.namespace("alice") != a.namespace(None)
    assert b.namespace("s") != a.namespace("s")
    auth.require_admin("Bearer admin-secret")
    with pytest.raises(APIError) as e:
        auth.require_admin("Bearer key-aaaaaaaa")
    assert e.value.status == 401
    with pytest.raises(APIError) as e:
        Authenticator(None, None).require_admin("Bearer x")
    assert e.value.status == 403
    # keys off: one anonymous tenant, salt still splits
    open_auth = Authenticator(None, None)
    anon = open_auth.authenticate(None)
    assert anon.tenant == ANONYMOUS and anon.namespace(None) is None
    assert anon.namespace("x") == (ANONYMOUS, "x")


@pytest.mark.parametrize(
    "content",
    ["not json", "[]", "{}", '{"short": "t"}', '{"long-enough-key": ""}', '{"long-enough-key": 3}'],
)
def test_bad_key_files(tmp_path, content: str) -> None:
    f = tmp_path / "k.json"
    f.write_text(content)
    with pytest.raises(ValueError):
        load_api_keys(f)


def test_missing_key_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "absent.json")


def test_metrics_registries_are_per_app() -> None:
    class Stats:
        prefix_cache_query_tokens = 100
        prefix_cache_hit_tokens = 75
        prefix_cache_hit_rate = 0.75
        kv_pages_used = 3
        kv_pages_total = 10
        num_running = 2
        num_waiting = 1
        evicted_pages = 4
        speculative_draft_tokens = 12
        speculative_accepted_tokens = 9

    m1, m2 = ServerMetrics(lambda: Stats(), model_name="m-1"), ServerMetrics(None)
    m1.observe_finished(
        finish_reason="stop",
        prompt_tokens=10,
        cached_tokens=8,
        completion_tokens=5,
        ttft=0.1,
        latency=0.5,
        queue_time=0.02,
    )
    m1.count_client_closed("body")
    m1.count_http_error(400)
    v1 = metric_values(m1.render().decode(), "m-1")
    v2 = metric_values(m2.render().decode(), "radixkv")
    assert v1['radixkv_requests_total{finish_reason="stop"}'] == 1.0
    assert v1["radixkv_prefix_cache_hit_rate"] == 0.75
    assert v1["radixkv_prefix_cache_hits_tokens_total"] == 75.0
    assert v1["radixkv_kv_pages_total"] == 10.0 and v1["radixkv_num_requests_waiting"] == 1.0
    assert v1["radixkv_spec_decode_num_draft_tokens_total"] == 12.0
    assert v1["radixkv_spec_decode_num_accepted_tokens_total"] == 9.0
    assert v1["radixkv_time_per_output_token_seconds_count"] == 1.0
    assert v1["radixkv_request_queue_time_seconds_count"] == 1.0
    assert v1["radixkv_request_queue_time_seconds_sum"] == pytest.approx(0.02)
    assert v1['radixkv_client_closed_requests_total{phase="body"}'] == 1.0
    assert v1['radixkv_client_closed_requests_total{phase="streaming"}'] == 0.0
    assert v1['radixkv_http_errors_total{status="400"}'] == 1.0
    assert 'radixkv_requests_total{finish_reason="stop"}' not in v2
    assert "radixkv_prefix_cache_hit_rate" not in v2
    with pytest.raises(ValueError, match="phase"):
        m1.count_client_closed("elsewhere")

    def broken() -> object:
        raise RuntimeError("boom")

    assert b"radixkv_prompt_tokens_total" in ServerMetrics(broken).render()  # scrape survives


@pytest.mark.parametrize(
    "kw",
    [
        {"max_queue": 0},
        {"max_body_bytes": 10},
        {"default_max_tokens": 0},
        {"model_name": ""},
        {"kv_events_replay": "tcp://127.0.0.1:1"},
    ],
)
def test_config_validation(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**kw)  # type: ignore[arg-type]


def test_every_engine_series_reads_a_real_engine_stats_field() -> None:
    from radixkv.engine.outputs import EngineStats
    from radixkv.server.metrics import _ENGINE_SERIES

    fields = set(EngineStats.__struct_fields__)
    assert {field for _, _, field in _ENGINE_SERIES.values()} <= fields
