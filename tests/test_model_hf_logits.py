"""radixkv's Llama-family forward against Hugging Face transformers (fp32, max abs diff <= 1e-4).

Every path a request can take through the paged KV cache is compared with one full forward pass of
the transformers model: full prefill, chunked prefill, prefill on top of pages another request
wrote (page-aligned and not, page sizes 1 and 16), decode steps, mixed batches, greedy decoding.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import EOS_ID, build_hf_model, hf_greedy, hf_logits, save_hf_folder

from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner, SeqInput

ATOL = 1e-4
KINDS = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "granite",
         "mistral_swa", "qwen2_swa", "gemma", "gemma2", "gemma3", "phi3", "smollm3",
         "ministral_swa", "smollm3_swa", "olmo2", "olmo3", "cohere", "cohere2", "granitemoe"]  # fmt: skip


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    hf = build_hf_model(kind, seed=KINDS.index(kind))
    folder = save_hf_folder(hf, tmp_path_factory.mktemp(kind))
    return hf, load_model(folder)


def _runner(lm: LoadedModel, page_size: int, num_pages: int = 256) -> ModelRunner:
    c = lm.config
    kv = KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
    return ModelRunner(lm.model, kv, backend="torch")


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=gen).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.2e} > {ATOL}"


def test_architecture_flags(pair: Any) -> None:
    hf, lm = pair
    arch = type(hf).__name__
    assert lm.config.architecture == arch
    assert lm.config.qkv_bias == arch.startswith("Qwen2")
    assert lm.config.qk_norm == arch.startswith(("Qwen3", "Gemma3", "Olmo", "CohereFor"))
    assert (lm.config.moe is not None) == ("Moe" in arch or arch == "MixtralForCausalLM")


def test_full_and_chunked_prefill(pair: Any) -> None:
    hf, lm = pair
    ids = _prompt(70, 1)
    ref = hf_logits(hf, ids)
    runner = _runner(lm, 16)
    pages = list(range(5, 10))
    _close(runner.forward([SeqInput(ids, pages, 0)], all_logits=True), ref)
    last = runner.forward([SeqInput(ids, pages, 0)])
    _close(last, ref[-1:])
    other = [40, 3, 77, 12, 9]
    parts = [
        runner.forward([SeqInput(ids[a:b], other, a)], all_logits=True)
        for a, b in ((0, 7), (7, 33), (33, 70))
    ]
    _close(torch.cat(parts), ref)


@pytest.mark.parametrize(
    ("page_size", "k", "shared_pages"),
    [(1, 23, True), (16, 32, True), (16, 23, False), (1, 1, True)],
)
def test_prefill_on_pages_of_an_earlier_request(
    pair: Any, page_size: int, k: int, shared_pages: bool
) -> None:
    """The new request's first k tokens' K/V come from pages an earlier request wrote."""
    hf, lm = pair
    runner = _runner(lm, page_size)
    target = _prompt(50, 2)
    need = (len(target) + page_size - 1) // page_size
    if shared_pages:
        # earlier request: same first k tokens, then different ones; its full pages are shared
        earlier = target[:k] + _prompt(30, 3)
        earlier_pages = list(range(100, 100 + (len(earlier) + page_size - 1) // page_size))
        runner.forward([SeqInput(earlier, earlier_pages, 0)])
        assert k % page_size == 0
        table = earlier_pages[: k // page_size]
        table += list(range(10, 10 + need - len(table)))
    else:
        # earlier request was exactly the first k tokens (k not page-aligned): continue its pages
        table = list(range(60, 60 + need))
        runner.forward([SeqInput(target[:k], table, 0)])
    got = runner.forward([SeqInput(target[k:], table, k)], all_logits=True)
    _close(got, hf_logits(hf, target)[k:])


def test_decode_steps_and_greedy_match_generate(pair: Any) -> None:
    hf, lm = pair
    runner = _runner(lm, 4)
    prompt = _prompt(19, 4)
    steps = 12
    table = list(range(50, 50 + (len(prompt) + steps + 3) // 4))
    out: list[int] = []
    step_logits = [runner.forward([SeqInput(prompt, table, 0)])[0]]
    while len(out) < steps:
        out.append(int(step_logits[-1].argmax()))
        if out[-1] == EOS_ID:
            break
        seq_len = len(prompt) + len(out)
        step_logits.append(runner.forward([SeqInput(out[-1:], table, seq_len - 1)])[0])
    assert out == hf_greedy(hf, prompt, steps)
    full = prompt + out
    ref = hf_logits(hf, full)[len(prompt) - 1 :]
    _close(torch.stack(step_logits), ref[: len(step_logits)])


def test_mixed_batch_of_different_lengths(pair: Any) -> None:
    hf, lm = pair
    runner = _runner(lm, 8)
    a, b, c, d = _prompt(33, 5), _prompt(9, 6), _prompt(61, 7), _prompt(1, 8)
    ta, tb, tc, td = (list(range(i * 10, i * 10 + 10)) for i in range(4))
    runner.forward([SeqInput(a[:-1], ta, 0)])  # a will decode its last token
    runner.forward([SeqInput(c[:40], tc, 0)])  # c will prefill a chunk on top of 40 tokens
    got = runner.forward(
        [
            SeqInput(a[-1:], ta, len(a) - 1),
            SeqInput(b, tb, 0),
            SeqInput(c[40:], tc, 40),
            SeqInput(d, td, 0),
        ],
        all_logits=True,
    )
    ref = torch.cat(
        [hf_logits(hf, a)[-1:], hf_logits(hf, b), hf_logits(hf, c)[40:], hf_logits(hf, d)]
    )
    _close(got, ref)


def test_llama3_rope_scaling_tied_embeddings(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 50000.0,
    }
    hf = build_hf_model("llama", seed=11, rope_parameters=rope, tie_word_embeddings=True)
    lm = load_model(save_hf_folder(hf, tmp_path / "m"))
    assert lm.config.tie_word_embeddings and lm.config.rope_scaling is not None
    assert lm.config.rope_scaling["rope_type"] == "llama3"
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    ids = _prompt(200, 9)
    runner = _runner(lm, 16)
    table = list(range(13))
    runner.forward([SeqInput(ids[:150], table, 0)])
    _close(
        runner.forward([SeqInput(ids[150:], table, 150)], all_logits=True), hf_logits(hf, ids)[150:]
    )


@pytest.mark.parametrize(
    "rope",
    [
        # Qwen2.5 / Qwen3's long-context setting (the original context given), old layout
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        # no original context: transformers takes max_position_embeddings
        {"rope_type": "yarn", "factor": 2.0},
        # DeepSeek's form: attention factor from mscale / mscale_all_dim, own betas
        {
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "attention_factor": 1.3, "truncate": False},
    ],
)  # fmt: skip
def test_yarn_rope_scaling(tmp_path: Path, rope: dict[str, Any]) -> None:
    """YaRN: inverse frequencies and the cos/sin attention factor as transformers computes
    them, so logits past the original context agree (prefill on cached pages included)."""
    import transformers

    key = "rope_scaling" if "type" in rope else "rope_parameters"
    hf = build_hf_model("qwen2", seed=14, **{key: {**rope, "rope_theta": 10000.0}})
    lm = load_model(save_hf_folder(hf, tmp_path / "m"))
    assert lm.config.rope_scaling is not None and lm.config.rope_scaling["rope_type"] == "yarn"
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inv, factor = init(hf.config, torch.device("cpu"))
    assert torch.allclose(lm.model.rotary.inv_freq, inv.float(), rtol=1e-6, atol=0)
    assert lm.model.rotary.attention_factor == pytest.approx(factor, rel=1e-12)
    assert (factor != 1.0) == (rope["factor"] > 1)
    ids = _prompt(200, 15)
    runner = _runner(lm, 16)
    table = list(range(13))
    runner.forward([SeqInput(ids[:128], table, 0)])
    _close(
        runner.forward([SeqInput(ids[128:], table, 128)], all_logits=True),
        hf_logits(hf, ids)[128:],
    )


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    hf = build_hf_model("qwen2", seed=12)
    folder = save_hf_folder(hf, tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    lm = load_model(folder)
    ids = _prompt(40, 10)
    _close(
        _runner(lm, 16).forward([SeqInput(ids, [0, 1, 2], 0)], all_logits=True), hf_logits(hf, ids)
    )


def test_bfloat16_load_is_close_to_fp32(tmp_path: Path) -> None:
    hf = build_hf_model("llama", seed=13)
    folder = save_hf_folder(hf, tmp_path / "bf16")
    lm = load_model(folder, dtype=torch.bfloat16)
    assert lm.model.dtype == torch.bfloat16 and lm.config.dtype == torch.bfloat16
    ids = _prompt(30, 11)
    got = _runner(lm, 16).forward([SeqInput(ids, [0, 1], 0)], all_logits=True)
    ref = hf_logits(hf, ids)
    assert got.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 0.1 * scale


def test_trained_radixkv_tiny_matches_transformers(tmp_path: Path) -> None:
    """The shipped radixkv-tiny weights, saved as a Hugging Face folder and loaded back by
    transformers, give the same logits and the same greedy tokens as radixkv's paged runner."""
    import transformers

    tiny = load_model("radixkv-tiny")
    c = tiny.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids),
    )
    folder = tmp_path / "radixkv-tiny-hf"
    build = transformers.LlamaForCausalLM(cfg).eval()
    build.load_state_dict(tiny.model.state_dict(), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build.save_pretrained(folder, safe_serialization=True)
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tiny.tokenizer.encode('def read_lines(path):\n    """Return the lines of *path*."""\n')
    runner = _runner(tiny, 16)
    table = list(range(12))
    _close(runner.forward([SeqInput(prompt, table, 0)], all_logits=True), hf_logits(hf, prompt))
    from radixkv import Engine, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (out,) = Engine(tiny, num_pages=64).generate([prompt], params, use_tqdm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.token_ids == ref[0, len(prompt) :].tolist()
