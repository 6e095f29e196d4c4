"""Loading HF folders: tokenizer, chat template, EOS ids, and error messages naming file and field."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _model_hf_builders import CHATML, EOS_ID, build_hf_model, save_hf_folder
from safetensors.torch import load_file, save_file

from radixkv.model.chat_template import ChatTemplateError, render_chat_template
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo wörld"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Prefix caching?"},
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_folder(build_hf_model("llama", seed=3), tmp_path_factory.mktemp("base") / "m")


@pytest.fixture
def folder(base: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(base, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _hf_tokenizer(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"),
            chat_template=CHATML,
            eos_token="<|im_end|>",
        )


def test_tokenizer_round_trip_and_matches_reference(base: Path) -> None:
    tok = load_model(base).tokenizer
    ref = _hf_tokenizer(base)
    for text in ["The quick brown fox.", "héllo wörld, 東京 ✓ <|im_start|>x", "", "  spaces  "]:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>") == [EOS_ID]
    assert tok.decode([EOS_ID, *tok.encode("ok")], skip_special_tokens=True) == "ok"
    assert tok.vocab_size == 300


def test_chat_template_renders_like_transformers(base: Path) -> None:
    tok = load_model(base).tokenizer
    ref = _hf_tokenizer(base)
    for gen_prompt in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt)
        theirs = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_chat_template_helpers() -> None:
    tmpl = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}|{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"role": "user", "content": 'a"b'}, {"role": "user", "content": "c"}]
    assert render_chat_template(tmpl, msgs) == '"a\\"b"|4'


def test_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    bad = "{{ raise_exception('no system role') }}"
    with pytest.raises(ChatTemplateError, match="no system role"):
        render_chat_template(bad, [{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no 'role'"):
        render_chat_template(CHATML, [{"content": "x"}])


def test_eos_ids_from_generation_config(folder: Path) -> None:
    assert load_model(folder).tokenizer.eos_token_ids == [EOS_ID]
    _edit_json(folder / "generation_config.json", eos_token_id=[EOS_ID, 0])
    assert load_model(folder).tokenizer.eos_token_ids == [EOS_ID, 0]
    _edit_json(folder / "generation_config.json", eos_token_id="end")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: field 'eos_token_id'"):
        load_model(folder)


def test_chat_template_file_takes_precedence(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_model(folder).tokenizer.apply_chat_template(MESSAGES) == "You are terse.!"


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(tmp_path / "nope")


def test_missing_config(folder: Path) -> None:
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file is missing"):
        load_model(folder)


def test_malformed_config_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON at line 1"):
        load_model(folder)


def test_unsupported_architecture(folder: Path) -> None:
    _edit_json(folder / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ModelLoadError, match=r"config\.json: field 'architectures': unsupported .*GPT2LMHeadModel"
    ):
        load_model(folder)


def test_missing_config_field(folder: Path) -> None:
    _edit_json(folder / "config.json", hidden_size=...)
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'hidden_size': missing"):
        load_model(folder)
    _edit_json(folder / "config.json", hidden_size=-3)
    with pytest.raises(ModelLoadError, match=r"field 'hidden_size': must be a positive integer"):
        load_model(folder)


def test_unsupported_rope_type(folder: Path) -> None:
    _edit_json(folder / "config.json", rope_parameters={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(
        ModelLoadError, match=r"field 'rope_parameters': unsupported rope type 'mrope'"
    ):
        load_model(folder)
    # longrope (Phi-3) needs its factors
    _edit_json(folder / "config.json", rope_parameters={"rope_type": "longrope", "factor": 4.0},
               original_max_position_embeddings=128)  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"'rope_parameters\.short_factor': must list"):
        load_model(folder)
    # dynamic NTK is refused with the reason (a cached prefix would need re-rotating)
    _edit_json(folder / "config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelLoadError, match=r"'dynamic': dynamic NTK .* prefix cache cannot"):
        load_model(folder)
    _edit_json(folder / "config.json", rope_parameters={"rope_type": "yarn", "factor": -4.0})
    with pytest.raises(
        ModelLoadError, match=r"field 'rope_parameters\.factor': must be a positive number"
    ):
        load_model(folder)
    _edit_json(
        folder / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4, "beta_fast": "x"}
    )
    with pytest.raises(ModelLoadError, match=r"'rope_parameters\.beta_fast': must be a positive"):
        load_model(folder)


def test_missing_weight(folder: Path) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: field 'model\.layers\.1\.mlp\.up_proj\.weight': missing weight",
    ):
        load_model(folder)


def test_shape_mismatch(folder: Path) -> None:
    _edit_json(folder / "config.json", intermediate_size=100)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: field 'model\.layers\.0\.mlp\.\w+_proj\.weight': shape",
    ):
        load_model(folder)


def test_unexpected_tensor(folder: Path) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"field 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(folder)


def test_missing_tokenizer_and_malformed_tokenizer_config(folder: Path) -> None:
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: malformed JSON"):
        load_model(folder)
    _edit_json_text = {"chat_template": 42}
    (folder / "tokenizer_config.json").write_text(json.dumps(_edit_json_text))
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: field 'chat_template'"):
        load_model(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file is missing"):
        load_model(folder)


def test_index_pointing_at_missing_shard(folder: Path) -> None:
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors\.index\.json: field 'weight_map\.model\.norm\.weight': shard",
    ):
        load_model(folder)


def test_no_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(folder)


def test_model_config_refuses_unknown_rope_types() -> None:
    """A ModelConfig built in code (not from config.json) checks its rope type too."""
    from radixkv.model.config import ModelConfig

    base = dict(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        ModelConfig(**base, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    cfg = ModelConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                            "original_max_position_embeddings": 64})  # fmt: skip
    assert cfg.rope_scaling is not None
