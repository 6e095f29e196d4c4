"""LoRA adapters in the model layer: PEFT folders read and applied, against PEFT's own logits,
alone and several in one batch, and the adapters we refuse with an error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import make_small_llama
from lora_helpers import ATTN, make_peft_adapter, peft_logits
from safetensors.torch import load_file, save_file

from radixkv.kv.kv_pool import KVPool
from radixkv.model.errors import ModelLoadError
from radixkv.model.lora import load_lora_adapter
from radixkv.model.runner import ModelRunner, SeqInput

ATOL = 1e-4
PAGE = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def adapters(base: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (folder, PEFT reference model): every linear layer; attention only with rsLoRA;
    MLP only with a per-module alpha (alpha_pattern) and another rank."""
    hf, _ = base
    root = tmp_path_factory.mktemp("adapters")
    specs: dict[str, dict[str, Any]] = {
        "all": dict(seed=1),
        "attn-rslora": dict(seed=2, r=4, target_modules=ATTN, use_rslora=True),
        "mlp-pattern": dict(
            seed=3, r=6, alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"],
            alpha_pattern={"down_proj": 3},
        ),
    }  # fmt: skip
    return {
        name: (root / name, make_peft_adapter(hf, root / name, **kw)) for name, kw in specs.items()
    }


def _runner(lm: Any) -> ModelRunner:
    cfg = lm.config
    pool = KVPool(
        num_pages=64, page_size=PAGE, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    return ModelRunner(lm.model, pool, backend="torch")


def _pages(start: int, n_tokens: int) -> list[int]:
    return list(range(start, start + (n_tokens + PAGE - 1) // PAGE))


def test_each_adapter_matches_peft(base: tuple[Any, Any], adapters: dict[str, Any]) -> None:
    hf, lm = base
    runner = _runner(lm)
    ids = [5, 17, 33, 9, 120, 7, 64, 250, 3, 11, 42]
    for name, (folder, ref) in adapters.items():
        slot = runner.loras.add(load_lora_adapter(folder, lm.config))
        out = runner.forward([SeqInput(ids, _pages(0, len(ids)), 0, slot)], all_logits=True)
        want = peft_logits(ref, ids)
        assert (out - want).abs().max().item() < ATOL, name
        # the adapter changes the logits (else the check above proves nothing)
        assert (want - peft_logits(hf, ids)).abs().max().item() > 0.1, name
        runner.loras.remove(slot)
    # with every adapter removed, no layer keeps a LoRA hook and the base logits come back
    assert not any(getattr(m, "lora", None) for m in lm.model.modules())
    out = runner.forward([SeqInput(ids, _pages(0, len(ids)), 0)], all_logits=True)
    assert (out - peft_logits(hf, ids)).abs().max().item() < ATOL


def test_mixed_batch_rows_get_their_own_adapter(
    base: tuple[Any, Any], adapters: dict[str, Any]
) -> None:
    """Prefill and decode rows of the base model and three adapters in one forward, the same
    adapter in non-adjacent sequences (rows gathered, not a single slice)."""
    hf, lm = base
    runner = _runner(lm)
    slots = {n: runner.loras.add(load_lora_adapter(f, lm.config)) for n, (f, _) in adapters.items()}
    refs = {None: hf} | {n: r for n, (_, r) in adapters.items()}
    plan = [("all", 9), (None, 6), ("attn-rslora", 7), ("all", 5), ("mlp-pattern", 8), (None, 3)]
    prompts = [[(13 * i + 7 * j) % 300 + 3 for j in range(n)] for i, (_, n) in enumerate(plan)]
    seqs, page = [], 0
    for (name, _), p in zip(plan, prompts):
        seqs.append(SeqInput(p, _pages(page, len(p) + 1), 0, slots[name] if name else 0))
        page += len(seqs[-1].page_table)
    runner.forward(seqs)
    # one decode token each, against the same pages: rows in one batch, each its own adapter
    nxt = [[(p[-1] * 5 + 1) % 300 + 3] for p in prompts]
    dec = [SeqInput(t, s.page_table, len(s.new_token_ids), s.lora_slot) for s, t in zip(seqs, nxt)]
    logits = runner.forward(dec)
    # several adapters on a layer: their factors were multiplied stacked (LoRALayer's docstring)
    assert lm.model.model.layers[0].self_attn.q_proj.lora._stack is not None
    for i, ((name, _), p) in enumerate(zip(plan, prompts)):
        want = peft_logits(refs[name], p + nxt[i])[-1]
        assert (logits[i] - want).abs().max().item() < ATOL, (i, name)
    for slot in slots.values():  # the module's model back without hooks (other tests share it)
        runner.loras.remove(slot)
    assert not any(getattr(m, "lora", None) for m in lm.model.modules())


def test_adapter_in_bf16_close_to_peft(base: tuple[Any, Any], adapters: dict[str, Any]) -> None:
    """The factors take the model's dtype: a bf16 model with a bf16 adapter stays within bf16
    rounding of the fp32 reference (the delta is not lost or doubled)."""
    _, lm = base
    folder, ref = adapters["all"]
    adapter = load_lora_adapter(folder, lm.config, dtype=torch.bfloat16)
    a, b = adapter.factors[(0, "q_proj")]
    assert a.weight.dtype == b.weight.dtype == torch.bfloat16
    ids = [5, 17, 33, 9, 120]
    x = torch.randn(len(ids), lm.config.hidden_size)
    lin = ref.base_model.model.model.layers[0].self_attn.q_proj
    want = lin(x) - lin.base_layer(x)  # PEFT's delta alone
    with torch.inference_mode():
        got = b(a(x.bfloat16())).float()
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_digest_names_the_content(base: tuple[Any, Any], adapters: dict[str, Any]) -> None:
    _, lm = base
    f_all, _ = adapters["all"]
    f_attn, _ = adapters["attn-rslora"]
    a1 = load_lora_adapter(f_all, lm.config)
    a2 = load_lora_adapter(f_all, lm.config, name="again")
    assert a1.digest == a2.digest and a1.name == "all" and a2.name == "again"
    assert load_lora_adapter(f_attn, lm.config).digest != a1.digest
    assert a1.modules == (
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj",
    )  # fmt: skip
    assert a1.rank == 8 and a1.num_parameters > 0


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(folder: Path, **fields: Any) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, fn: Any) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path))


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    "break_it, file, message",
    [
        (lambda f: _edit_config(f, use_dora=True), "adapter_config.json", "DoRA"),
        (lambda f: _edit_config(f, modules_to_save=["lm_head"]), "adapter_config.json",
         "replace whole modules"),
        (lambda f: _edit_config(f, bias="all"), "adapter_config.json", "biases"),
        (lambda f: _edit_config(f, peft_type="PREFIX_TUNING"), "adapter_config.json",
         "'PREFIX_TUNING' adapters are not supported"),
        (lambda f: _edit_config(f, lora_alpha=-1), "adapter_config.json", "lora_alpha"),
        (lambda f: (f / "adapter_config.json").write_text("{not json"), "adapter_config.json",
         "malformed JSON"),
        (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json", "missing"),
        (lambda f: (f / "adapter_model.safetensors").rename(f / "adapter_model.bin"),
         "adapter_model.safetensors", "pickle"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"garbage"),
         "adapter_model.safetensors", "cannot read safetensors"),
        (lambda f: _edit_tensors(f, lambda t: t.pop(Q_B)), "adapter_model.safetensors",
         "lora_B.weight"),
        (lambda f: _edit_tensors(f, lambda t: t.update({Q_A: t[Q_A][:, :-1].contiguous()})),
         "adapter_model.safetensors", "does not fit the model"),
        (lambda f: _edit_tensors(f, lambda t: t.update({Q_B: t[Q_B][:-2].contiguous()})),
         "adapter_model.safetensors", "does not fit the model"),
        (lambda f: _edit_tensors(f, lambda t: t.update({Q_A.replace("layers.0", "layers.9"):
         t[Q_A]})), "adapter_model.safetensors", "layer 9 does not exist"),
        (lambda f: _edit_tensors(f, lambda t: t.update({
            "base_model.model.model.embed_tokens.lora_embedding_A": t[Q_A]})),
         "adapter_model.safetensors", "embeddings"),
        (lambda f: _edit_tensors(f, lambda t: t.update({
            "base_model.model.lm_head.lora_A.weight": t[Q_A]})),
         "adapter_model.safetensors", "LM head"),
        (lambda f: _edit_tensors(f, lambda t: t.update({
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
            t[Q_A][0]})), "adapter_model.safetensors", "DoRA"),
        (lambda f: _edit_tensors(f, lambda t: [t.pop(k) for k in list(t)] and
         t.update({"x": torch.zeros(1)}) and None), "adapter_model.safetensors",
         "not a LoRA factor"),
    ],
)  # fmt: skip
def test_bad_adapters_are_refused_naming_the_problem(
    base: tuple[Any, Any], adapters: dict[str, Any], tmp_path: Path,
    break_it: Any, file: str, message: str,
) -> None:  # fmt: skip
    _, lm = base
    folder = _copy(adapters["all"][0], tmp_path / "broken")
    break_it(folder)
    with pytest.raises(ModelLoadError, match=message) as exc:
        load_lora_adapter(folder, lm.config)
    assert file in str(exc.value)


def test_missing_folder_and_foreign_model(base: tuple[Any, Any], tmp_path: Path) -> None:
    _, lm = base
    with pytest.raises(ModelLoadError, match=r"not a LoRA adapter folder \(no such directory\)"):
        load_lora_adapter(tmp_path / "nowhere", lm.config)
    # an adapter of a model with another hidden size does not fit this one
    from _model_hf_builders import build_hf_model

    other = build_hf_model("llama", seed=0, hidden_size=32, intermediate_size=48)
    make_peft_adapter(other, tmp_path / "other", seed=0)
    with pytest.raises(
        ModelLoadError,
        match=r"down_proj.lora_A.weight'?: shape \(8, 48\) does not fit the model: "
        r"expected \(r, 96\)",
    ):
        load_lora_adapter(tmp_path / "other", lm.config)


def test_adapter_from_a_hub_repo_id(
    base: tuple[Any, Any], adapters: dict[str, Any], tmp_path: Path, monkeypatch: Any
) -> None:
    """A Hugging Face repo id is fetched through the Hub cache (here one laid out on disk, used
    offline): the same adapter as from its folder; an id the cache lacks names the repo."""
    from _model_hf_builders import write_hub_snapshot

    _, lm = base
    folder, _ = adapters["all"]
    write_hub_snapshot(tmp_path / "hub", "org/sql-lora", folder, "a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from_hub = load_lora_adapter("org/sql-lora", lm.config)
    assert from_hub.digest == load_lora_adapter(folder, lm.config).digest
    assert from_hub.path == from_hub.name == "org/sql-lora"
    with pytest.raises(ModelLoadError, match=r"org/other.*cannot get the LoRA adapter"):
        load_lora_adapter("org/other", lm.config)
