"""Model sources: Hugging Face repo ids through a real Hub cache layout (offline), the served
name, --revision, --tokenizer and --chat-template overrides, and dtype "auto"."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _model_hf_builders import CHATML, EOS_ID, build_hf_model, save_hf_folder, write_hub_snapshot

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model import dtype as dtype_mod
from radixkv.model.cpu_bf16 import CpuBf16, cpu_bf16
from radixkv.model.dtype import DtypeChoice, auto_dtype
from radixkv.model.errors import ModelLoadError
from radixkv.model.hub import MODEL_FILES, folder_display_name, looks_like_repo_id
from radixkv.model.loader import load_model, load_tokenizer
from radixkv.server import add_serve_arguments, build_from_args
from radixkv.server.background import BackgroundServer

REPO = "acme/tiny-llama"
TOK_REPO = "acme/other-tokenizer"
MAIN = "a1" * 20  # commit ids (40 hex digits)
V2 = "b2" * 20
TOK_COMMIT = "c3" * 20
V2_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
OTHER_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
CHAT = [{"role": "user", "content": "The quick brown fox"}]


class Hub:
    def __init__(self, root: Path) -> None:
        self.home = root / "hf_home"
        self.cache = self.home / "hub"
        source = save_hf_folder(build_hf_model("llama", seed=11), root / "source")
        self.main = write_hub_snapshot(self.cache, REPO, source, MAIN)
        # revision "v2": the same weights stored as bfloat16 per config.json, another template
        v2 = root / "source-v2"
        shutil.copytree(source, v2)
        _edit_json(v2 / "config.json", torch_dtype="bfloat16")
        _edit_json(v2 / "tokenizer_config.json", chat_template=V2_TEMPLATE)
        self.v2 = write_hub_snapshot(self.cache, REPO, v2, V2, refs=("v2",))
        # a tokenizer-only repo with its own template and EOS
        tok = root / "tok"
        tok.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, tok / name)
        _edit_json(tok / "tokenizer_config.json", chat_template=OTHER_TEMPLATE)
        (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
        self.tok_folder = tok
        write_hub_snapshot(self.cache, TOK_REPO, tok, TOK_COMMIT)


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    return Hub(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def offline(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> Hub:
    """HF_HOME at the test cache, HF_HUB_OFFLINE=1, and no socket may connect past loopback
    (the test servers listen there)."""
    monkeypatch.setenv("HF_HOME", str(hub.home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    connect = socket.socket.connect

    def loopback_only(self: socket.socket, address: Any) -> None:
        if not (isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1", "localhost")):
            raise AssertionError(f"network access attempted: {address}")
        connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return hub


def _weights(lm: Any) -> dict[str, torch.Tensor]:
    return dict(lm.model.state_dict())


def test_repo_id_loads_through_the_hub_cache_under_its_own_name(offline: Hub) -> None:
    lm = load_model(REPO)
    assert lm.name == REPO  # what the user passed, not the snapshot's commit
    direct = load_model(offline.main)
    assert direct.name == REPO  # a snapshot folder is served as org/name too
    for key, value in _weights(direct).items():
        assert torch.equal(_weights(lm)[key], value), key
    assert lm.tokenizer.chat_template == CHATML
    assert lm.tokenizer.encode("The quick brown fox") == direct.tokenizer.encode(
        "The quick brown fox"
    )
    assert folder_display_name(Path("/x/models--org--a.b-c/snapshots/" + MAIN)) == "org/a.b-c"
    assert folder_display_name(Path("/x/plain-folder")) == "plain-folder"


def test_engine_on_a_repo_id_generates_as_from_the_folder(offline: Hub) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_id = Engine(REPO, num_pages=64).generate("The quick brown fox", params, use_tqdm=False)
    by_path = Engine(str(offline.main), num_pages=64).generate(
        "The quick brown fox", params, use_tqdm=False
    )
    assert by_id[0].token_ids == by_path[0].token_ids and len(by_id[0].token_ids) == 6


def test_revision_picks_a_branch_or_a_commit(offline: Hub) -> None:
    assert load_tokenizer(REPO, revision="v2").chat_template == V2_TEMPLATE
    assert load_tokenizer(REPO, revision=V2).chat_template == V2_TEMPLATE
    assert load_tokenizer(REPO, revision=MAIN).chat_template == CHATML
    with pytest.raises(ModelLoadError, match=r"at revision 'nope'.*HF_HUB_OFFLINE is set"):
        load_tokenizer(REPO, revision="nope")
    with pytest.raises(ModelLoadError, match="revision 'v2' applies to Hugging Face repo ids"):
        load_model(offline.main, revision="v2")
    with pytest.raises(ModelLoadError, match="repo ids only"):
        load_model("radixkv-tiny-random", revision="v2")


def test_missing_repo_offline_names_the_cache_and_the_setting(offline: Hub) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model("acme/not-downloaded")
    msg = str(e.value)
    assert "acme/not-downloaded" in msg and "HF_HUB_OFFLINE is set" in msg
    assert str(offline.cache) in msg
    with pytest.raises(ModelLoadError, match=r"not a model folder .* not a Hugging Face repo id"):
        load_model("no-such-folder")
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    for text in ("no-slash", "a/b/c", "org/../x", "org--x/y", "/abs/path", "./rel"):
        assert not looks_like_repo_id(text), text


def test_hf_hub_cache_wins_over_hf_home(offline: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(offline.home / "elsewhere"))
    with pytest.raises(ModelLoadError, match="elsewhere"):
        load_tokenizer(REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(offline.cache))
    assert load_tokenizer(REPO).chat_template == CHATML


def test_only_config_weights_and_tokenizer_files_are_requested(
    offline: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    calls: list[dict[str, Any]] = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id: str, **kw: Any) -> str:
        calls.append({"repo_id": repo_id, **kw})
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    load_model(REPO, revision="v2")
    (call,) = calls
    assert call["repo_id"] == REPO and call["revision"] == "v2"
    assert call["local_files_only"] is True and call["cache_dir"] == str(offline.cache)
    listing = [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
        "pytorch_model.bin", "original/consolidated.00.pth", "README.md", "onnx/model.onnx",
        "flax_model.msgpack", "tf_model.h5", ".gitattributes",
    ]  # fmt: skip
    fetched = set(filter_repo_objects(listing, allow_patterns=call["allow_patterns"]))
    assert fetched == set(listing[:9])
    assert call["allow_patterns"] == list(MODEL_FILES)


def test_served_model_name_is_the_repo_id_or_the_override(offline: Hub) -> None:
    def parse(*argv: str) -> argparse.Namespace:
        return add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))

    app, _ = build_from_args(parse("--model", REPO, "--num-pages", "64"))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [REPO]
        body = {"model": REPO, "messages": CHAT, "max_tokens": 2}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == REPO
    app, _ = build_from_args(
        parse("--model-path", str(offline.main), "--served-model-name", "mine", "--num-pages", "8")
    )
    assert app.state.radixkv.model_name == "mine"
    app, _ = build_from_args(parse("--model", str(offline.main), "--num-pages", "8"))
    assert app.state.radixkv.model_name == REPO  # never the snapshot's commit id


def test_tokenizer_override_from_a_folder_or_a_repo_id(offline: Hub) -> None:
    for source in (str(offline.tok_folder), TOK_REPO):
        tok = load_model(REPO, tokenizer=source).tokenizer
        assert tok.chat_template == OTHER_TEMPLATE
        assert tok.eos_token_ids == [EOS_ID]  # EOS still from the model's generation_config
    engine = Engine(REPO, tokenizer=TOK_REPO, num_pages=16)
    assert engine.tokenizer.chat_template == OTHER_TEMPLATE
    with pytest.raises(ModelLoadError, match="not a tokenizer folder"):
        load_model(REPO, tokenizer="./missing-tokenizer")


def test_chat_template_override_from_a_file_or_inline(offline: Hub, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(OTHER_TEMPLATE)
    tok = load_model(REPO, chat_template=str(path)).tokenizer
    assert tok.apply_chat_template(CHAT) == "<The quick brown fox>"
    inline = "{{ messages[-1]['content'] }}!"
    assert load_model("radixkv-tiny-random", chat_template=inline).tokenizer.chat_template == inline
    long = "{{ messages[-1]['content'] }}" + " " * 300  # longer than a file name may be
    assert load_model("radixkv-tiny-random", chat_template=long).tokenizer.chat_template == long
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("radixkv-tiny-random", chat_template="templates/missing.jinja")
    lm = load_model("radixkv-tiny-random")
    with pytest.raises(ValueError, match="pass them to load_model"):
        Engine(lm, chat_template=inline)
    # the serve flags reach the loader
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", REPO, "--chat-template", str(path), "--num-pages", "8", "--revision", "v2"]
    )
    app, _ = build_from_args(args)
    core = app.state.radixkv.engine.engine
    assert core.tokenizer.chat_template == OTHER_TEMPLATE
    assert core.config.revision == "v2"


def test_auto_dtype_rule() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")  # meta: a non-CPU device, no CUDA
    plain, native = CpuBf16(False, "no bf16 flags"), CpuBf16(True, "avx512_bf16")
    for half in (torch.bfloat16, torch.float16):
        choice = auto_dtype(half, cpu, bf16=plain)
        assert choice.dtype == torch.float32 and choice.note and "float32" in choice.note
        assert "no bf16 flags" in choice.note  # the evidence is in the log line
        assert auto_dtype(half, meta) == DtypeChoice(half)  # a GPU keeps half precision
    # a CPU with native bf16 units runs everything in bf16, saying so when it changes the dtype
    assert auto_dtype(torch.bfloat16, cpu, bf16=native) == DtypeChoice(torch.bfloat16)
    for other in (torch.float16, torch.float32):
        moved = auto_dtype(other, cpu, bf16=native)
        assert moved.dtype == torch.bfloat16 and moved.note and "avx512_bf16" in moved.note
    # float32: kept on a CPU without bf16 units, half precision on a GPU (as vLLM's auto)
    assert auto_dtype(torch.float32, cpu, bf16=plain) == DtypeChoice(torch.float32)
    gpu = auto_dtype(torch.float32, meta)
    assert gpu.dtype == torch.bfloat16 and gpu.note and "float32" in gpu.note
    # this machine's answer is used when none is passed
    assert auto_dtype(torch.bfloat16, cpu).dtype == (
        torch.bfloat16 if cpu_bf16().native else torch.float32
    )


def test_dtype_auto_on_the_tiny_model_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_mod, "cpu_bf16", lambda: CpuBf16(True, "avx512_bf16"))
    assert next(load_model("radixkv-tiny", dtype="auto").model.parameters()).dtype == (
        torch.bfloat16
    )
    monkeypatch.setattr(dtype_mod, "cpu_bf16", lambda: CpuBf16(False, "no bf16 flags"))
    assert next(load_model("radixkv-tiny", dtype="auto").model.parameters()).dtype == (
        torch.float32
    )
    assert next(load_model("radixkv-tiny").model.parameters()).dtype == torch.float32


def test_dtype_auto_serves_a_bf16_checkpoint_in_fp32_on_a_cpu_without_bf16_units(
    offline: Hub, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dtype_mod, "cpu_bf16", lambda: CpuBf16(False, "no bf16 flags"))
    with caplog.at_level(logging.INFO, logger="radixkv.model"):
        lm = load_model(REPO, revision="v2", dtype="auto")
    assert next(lm.model.parameters()).dtype == torch.float32
    assert any("bfloat16, served in float32 on the CPU" in r.getMessage() for r in caplog.records)
    # the default is unchanged: the checkpoint's dtype as stored
    assert next(load_model(REPO, revision="v2").model.parameters()).dtype == torch.bfloat16
    assert EngineConfig().dtype is None
    engine = Engine(REPO, revision="v2", dtype="auto", num_pages=8)
    assert engine.kv_pool.dtype == torch.float32
    # with native bf16 units the checkpoint's bf16 is kept
    monkeypatch.setattr(dtype_mod, "cpu_bf16", lambda: CpuBf16(True, "avx512_bf16"))
    assert Engine(REPO, revision="v2", dtype="auto", num_pages=8).kv_pool.dtype == torch.bfloat16


def test_dtype_values() -> None:
    assert EngineConfig(dtype="auto").dtype == "auto"
    assert EngineConfig(dtype=torch.float16).dtype == torch.float16
    assert EngineConfig(dtype="torch.bfloat16").dtype == "torch.bfloat16"
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="fp8")
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(parser.parse_args(["--dtype", "auto"])).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
