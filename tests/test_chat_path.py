"""One chat path: Engine.chat, the server's chat completions, the Ray ingress's routing hints and
`radixkv generate --chat` turn a conversation into the same token ids (one BOS, written by the
template), the same ids transformers' apply_chat_template(tokenize=True) gives; tools,
chat_template_kwargs and tojson's arguments render as in transformers."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
from _model_hf_builders import build_hf_model, save_hf_folder

from radixkv.cli import main as radixkv_main
from radixkv.cluster.hinting import PromptHasher, load_tokenizer
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.chat_template import ChatTemplateError, render_chat_template
from radixkv.model.tokenizer import encode_chat
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig

BOS = "<|endoftext|>"  # id 0 in the test tokenizer; its post-processor prepends it
BOS_ID = 0
# writes bos_token like Llama's templates; lists tools with tojson; Qwen3's enable_thinking switch
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city (°C)",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint whose tokenizer adds BOS when encoding and whose template writes it."""
    from tokenizers import Tokenizer, processors

    path = save_hf_folder(build_hf_model("llama", seed=4), tmp_path_factory.mktemp("bos") / "m")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.token_to_id(BOS) == BOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(bos_token=BOS, chat_template=TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def engine(folder: Path) -> Engine:
    return Engine(str(folder), num_pages=128)


def _reference(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"),
            chat_template=TEMPLATE,
            bos_token=BOS,
            eos_token="<|im_end|>",
        )


def _ref_ids(ref: Any, conv: list[dict[str, Any]], **kw: Any) -> list[int]:
    out = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_engine_chat_ids_match_transformers_with_one_bos(engine: Engine, folder: Path) -> None:
    ref = _reference(folder)
    params = SamplingParams(temperature=0, max_tokens=3)
    out = engine.chat(CONV, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == _ref_ids(ref, CONV)
    assert out.prompt_token_ids[0] == BOS_ID and out.prompt_token_ids[1] != BOS_ID
    assert out.prompt_token_ids.count(BOS_ID) == 1
    extras: dict[str, Any] = {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    with_tools = engine.chat(CONV, params, use_tqdm=False, **extras)[0]
    assert with_tools.prompt_token_ids == _ref_ids(ref, CONV, tools=TOOLS, enable_thinking=False)
    text = engine.tokenizer.decode(with_tools.prompt_token_ids)
    assert '"name": "get_weather"' in text and "°C" in text and text.endswith("</think>\n\n")
    # a list of conversations, outputs in order
    two = engine.chat([CONV, CONV[1:]], sampling_params=params, use_tqdm=False)
    assert two[0].prompt_token_ids == out.prompt_token_ids
    assert two[1].prompt_token_ids == encode_chat(engine.tokenizer, CONV[1:])
    assert two[0].token_ids == out.token_ids  # greedy: same reply, now from the cache
    assert two[0].num_cached_tokens > 0
    engine.check_invariants()


def test_chat_errors(engine: Engine) -> None:
    with pytest.raises(TypeError, match="messages must be a conversation"):
        engine.chat("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="messages must be a conversation"):
        engine.chat([])
    with pytest.raises(ChatTemplateError, match="may not set add_generation_prompt"):
        engine.chat(CONV, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ChatTemplateError, match="tools must be a list"):
        engine.chat(CONV, tools={"name": "x"})  # type: ignore[arg-type]
    assert not engine.has_unfinished()


def test_a_rendered_template_passed_as_text_gets_two_bos_and_a_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """What the issue saw: the template writes BOS and encoding adds another. Engine.chat is the
    fix; the text path warns once."""
    text = engine.tokenizer.apply_chat_template(CONV)
    params = SamplingParams(max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="radixkv.engine.intake"):
        out = engine.generate([text, text], params, use_tqdm=False)
    assert out[0].prompt_token_ids[:2] == [BOS_ID, BOS_ID]
    warned = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert len(warned) == 1 and "Engine.chat" in warned[0] and BOS in warned[0]
    assert (
        out[0].prompt_token_ids[1:] == engine.chat(CONV, params, use_tqdm=False)[0].prompt_token_ids
    )


def test_server_chat_completions_encode_as_engine_chat(engine: Engine, folder: Path) -> None:
    server = AsyncEngine(str(folder), num_pages=128)
    seen: list[list[int]] = []
    core = server.engine
    prepare = core.prepare

    def spy(prompt: Any, *args: Any, **kw: Any) -> Any:
        seen.append(list(prompt))
        return prepare(prompt, *args, **kw)

    core.prepare = spy  # type: ignore[method-assign]
    app = build_app(server, ServerConfig(model_name="m"), owns_engine=True)
    params = SamplingParams(temperature=0, max_tokens=3)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        body: dict[str, Any] = {"model": "m", "messages": CONV, "max_tokens": 3, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        python = engine.chat(CONV, params, use_tqdm=False)[0]
        assert seen[-1] == python.prompt_token_ids
        assert r.json()["usage"]["prompt_tokens"] == len(python.prompt_token_ids)
        assert r.json()["choices"][0]["message"]["content"] == python.text
        body |= {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        extras: dict[str, Any] = {
            "tools": TOOLS,
            "chat_template_kwargs": body["chat_template_kwargs"],
        }
        assert seen[-1] == engine.chat(CONV, params, use_tqdm=False, **extras)[0].prompt_token_ids
        body["chat_template_kwargs"] = {"messages": []}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "may not set messages" in r.json()["error"]["message"]
    # the Ray ingress hashes prompts with the same ids
    hasher = PromptHasher(load_tokenizer(str(folder)), 16)
    got = hasher.token_ids(
        "/v1/chat/completions",
        json.dumps(body | {"chat_template_kwargs": {"enable_thinking": False}}).encode(),
    )
    assert got is not None and got[0] == seen[-1]


def test_tojson_takes_transformers_arguments(folder: Path) -> None:
    ref = _reference(folder)
    value = {"b": "é", "a": [1, {"z": None}]}
    for args in (
        "",
        "indent=2",
        "ensure_ascii=True",
        "separators=(',', ':')",
        "sort_keys=True",
        "indent=4, sort_keys=True, ensure_ascii=True",
    ):
        tmpl = "{{ messages[0]['content'] | tojson(" + args + ") }}"
        conv = [{"role": "user", "content": value}]
        ours = render_chat_template(tmpl, conv)
        theirs = ref.apply_chat_template(conv, chat_template=tmpl, tokenize=False)
        assert ours == theirs, args
    assert (
        render_chat_template(
            "{{ messages[0]['content'] | tojson }}", [{"role": "u", "content": "<é>"}]
        )
        == '"<é>"'
    )
    # keys set to None are dropped before rendering, as transformers does
    tmpl = "{{ 'named' if messages[0].name is defined else 'anonymous' }}"
    conv = [{"role": "user", "content": "x", "name": None}]
    assert render_chat_template(tmpl, conv) == "anonymous"
    assert ref.apply_chat_template(conv, chat_template=tmpl, tokenize=False) == "anonymous"
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{{ messages | tojson(indent=[1]) }}", [{"role": "u"}])


def test_generate_chat_cli_matches_engine_chat(capsys: pytest.CaptureFixture[str]) -> None:
    msgs = [{"role": "user", "content": "def read_lines(path):"}]
    want = Engine("radixkv-tiny", num_pages=64).chat(
        msgs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert want.prompt_token_ids[0] != 256  # the tiny template writes no BOS; none is added
    argv = [
        "generate",
        "--model",
        "radixkv-tiny",
        "--chat",
        msgs[0]["content"],
        "--max-tokens",
        "12",
    ]
    assert radixkv_main(argv) == 0
    assert capsys.readouterr().out == want.text + "\n"
    assert radixkv_main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
