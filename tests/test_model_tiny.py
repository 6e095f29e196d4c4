"""radixkv-tiny through ModelRunner: determinism, paging invariance, validation."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv.engine.prefill_cost import attention_cost_ratio
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner, SeqInput


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


def _runner(lm: LoadedModel, page_size: int = 16, num_pages: int = 64) -> ModelRunner:
    c = lm.config
    kv = KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
    return ModelRunner(lm.model, kv, backend="auto")


def test_tiny_is_deterministic_and_sized(tiny: LoadedModel) -> None:
    other = load_model("radixkv-tiny")
    for (n1, p1), (n2, p2) in zip(tiny.model.named_parameters(), other.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    c = tiny.config
    assert c.architecture == "LlamaForCausalLM"
    assert c.max_position_embeddings >= 8192
    # the split of FLOPs between linear layers and attention of a 7B-70B model (see tiny.py)
    assert 26_000 <= attention_cost_ratio(c) <= 53_000
    assert c.head_dim in (64, 128, 256)  # head sizes FlashInfer compiles
    assert tiny.tokenizer.vocab_size == c.vocab_size
    assert tiny.name == "radixkv-tiny"


def test_chunked_prefill_and_decode_match_full_prefill(tiny: LoadedModel) -> None:
    runner = _runner(tiny, page_size=16)
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    n = len(ids)
    pt = list(range(10, 10 + (n + 15) // 16))
    full = runner.forward([SeqInput(ids, pt, 0)], all_logits=True)
    assert full.shape == (n, tiny.config.vocab_size) and full.dtype == torch.float32
    pt2 = list(reversed(range(30, 30 + (n + 15) // 16)))  # different, non-monotone pages
    parts = []
    for a, b in ((0, 21), (21, 40), (40, n - 3)):
        parts.append(runner.forward([SeqInput(ids[a:b], pt2, a)], all_logits=True))
    for i in range(n - 3, n):  # decode steps
        parts.append(runner.forward([SeqInput([ids[i]], pt2, i)]))
    # allow a few fp32 ulps of large logits on top of the absolute 1e-4 that the Hugging Face
    # comparisons use
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=1e-6)


def test_mixed_batch_matches_separate_runs(tiny: LoadedModel) -> None:
    runner = _runner(tiny, page_size=4, num_pages=128)
    prompts = [tiny.tokenizer.encode(t) for t in ("abc", "hello there, friend", "x" * 41)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    # sequence 0 and 2: prefill all but the last token first, then decode it in a mixed batch
    runner.forward([SeqInput(prompts[0][:-1], tables[0], 0)])
    runner.forward([SeqInput(prompts[2][:-1], tables[2], 0)])
    mixed = runner.forward(
        [
            SeqInput(prompts[0][-1:], tables[0], len(prompts[0]) - 1),
            SeqInput(prompts[1], tables[1], 0),
            SeqInput(prompts[2][-1:], tables[2], len(prompts[2]) - 1),
        ]
    )
    fresh = _runner(tiny, page_size=4, num_pages=128)
    for i, p in enumerate(prompts):
        alone = fresh.forward([SeqInput(p, tables[i], 0)])
        torch.testing.assert_close(mixed[i], alone[0], atol=1e-4, rtol=1e-6)


def test_bad_batches_raise_and_leave_pool_untouched(tiny: LoadedModel) -> None:
    runner = _runner(tiny, page_size=16, num_pages=4)
    before = runner.kv_pool.k.clone()
    with pytest.raises(ValueError, match="page table has 1"):
        runner.forward([SeqInput(list(range(20)), [0], 0)])
    with pytest.raises(ValueError, match="out of range"):
        runner.forward([SeqInput([1, 2], [9], 0)])
    with pytest.raises(ValueError, match="token id"):
        runner.forward([SeqInput([tiny.config.vocab_size], [0], 0)])
    with pytest.raises(ValueError, match="at least one new token"):
        runner.forward([SeqInput([], [0], 0)])
    with pytest.raises(ValueError, match="empty batch"):
        runner.forward([])
    assert torch.equal(before, runner.kv_pool.k)


def test_runner_rejects_mismatched_pool(tiny: LoadedModel) -> None:
    c = tiny.config
    kv = KVPool(c.num_layers + 1, 4, 16, c.num_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match="num_layers"):
        ModelRunner(tiny.model, kv)
    kv = KVPool(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match="unknown attention backend"):
        ModelRunner(tiny.model, kv, backend="cuda-magic")
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(tiny.model, kv, backend="flashinfer")


def test_tiny_tokenizer_and_chat_template(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    text = "héllo, wörld ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode(text)[0] == 256  # BOS
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert rendered == "<|system|>be brief<|end|>\n<|user|>hi<|end|>\n<|assistant|>"
    enc = tok.encode(rendered, add_special_tokens=False)
    assert enc[0] == 258 and 261 in enc and enc[-1] == 260
    assert tok.decode(enc, skip_special_tokens=True) == "be brief\nhi\n"
    assert set(tok.eos_token_ids) == {257, 261}
    with pytest.raises(ValueError, match="unsupported role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_tiny_random_speaks_printable_ascii_and_samples_vary() -> None:
    from radixkv import Engine, SamplingParams
    from radixkv.model.tiny import PRINTABLE

    eng = Engine("radixkv-tiny-random", num_pages=256)
    prompt = "Problem: a farmer has 17 sheep. Think step by step."
    greedy = eng.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert all(t in PRINTABLE for t in greedy[0].token_ids)
    again = eng.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert again[0].token_ids == greedy[0].token_ids
    params = SamplingParams(max_tokens=32, temperature=0.8, n=3, seed=7)
    (out,) = eng.generate([prompt], params, use_tqdm=False)
    samples = {tuple(c.token_ids) for c in out.outputs}
    assert len(samples) > 1  # sampling explores; a tied random head mostly repeats its input


# Python the model has not seen verbatim (written for this test, in the standard library's style)
SNIPPET = '''def read_config(path, defaults=None):
    """Return the settings in the file at *path* as a dictionary.

    Lines that are empty or start with a hash are ignored. Every other line
    must have the form ``name = value``; the value is stripped of spaces.
    """
    settings = dict(defaults or {})
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep:
                raise ValueError("line %d: expected name = value" % lineno)
            settings[name.strip()] = value.strip()
    return settings
'''


def _bits_per_byte(lm: LoadedModel, text: str) -> float:
    ids = lm.tokenizer.encode(text)
    runner = _runner(lm, page_size=16, num_pages=(len(ids) + 15) // 16)
    logits = runner.forward([SeqInput(ids, list(range((len(ids) + 15) // 16)), 0)], all_logits=True)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(nll) / math.log(2)


def test_trained_tiny_predicts_python_and_writes_it(tiny: LoadedModel) -> None:
    """The packaged weights are the trained ones: far better than random on unseen Python."""
    from radixkv import Engine, SamplingParams
    from radixkv.model.tiny import tiny_training_summary

    trained = _bits_per_byte(tiny, SNIPPET)
    random = _bits_per_byte(load_model("radixkv-tiny-random"), SNIPPET)
    assert trained < 3.0 < 8.0 < random, (trained, random)
    summary = tiny_training_summary()
    assert (
        len(summary["corpus"]["sha256"]) == 64 and summary["steps_run"] == summary["args"]["steps"]
    )
    assert summary["held_out"]["trained_bits_per_byte"] < 3.0

    eng = Engine(tiny, num_pages=128, seed=0)
    prompt = "def read_lines(path):\n"
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    (greedy,) = eng.generate([prompt], params, use_tqdm=False)
    (again,) = eng.generate([prompt], params, use_tqdm=False)
    assert again.token_ids == greedy.token_ids
    assert greedy.text.startswith("    ")  # a body, indented under the signature
    assert greedy.text.isascii() and all(ch.isprintable() or ch == "\n" for ch in greedy.text)
    sampled = SamplingParams(max_tokens=32, temperature=0.8, n=3, seed=7, ignore_eos=True)
    (out,) = eng.generate([prompt], sampled, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
