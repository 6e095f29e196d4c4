"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the logits checks of
test_model_hf_logits.py (which runs every paged path against transformers for them too): the
engine's greedy outputs equal transformers' under every scheduling shape, cache hit or miss;
routing and expert outputs in bf16 equal transformers' bf16 block; only the chosen experts run;
config errors name the field; LoRA reaches attention and dense layers and refuses experts."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import MOE, build_hf_model, hf_greedy, save_hf_folder
from engine_helpers import run_checked, shared_prefix_prompts
from lora_helpers import make_peft_adapter, peft_logits

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.prefill_cost import attention_cost_ratio, weights_per_active
from radixkv.kv.kv_pool import KVPool
from radixkv.model.config import ModelConfig, MoEConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model
from radixkv.model.lora import load_lora_adapter, save_random_adapter
from radixkv.model.moe import SparseMoE
from radixkv.model.runner import ModelRunner, SeqInput

KINDS = list(MOE)  # mixtral, qwen2_moe, granitemoe, qwen3_moe
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    hf = build_hf_model(kind, seed=20 + KINDS.index(kind))
    folder = save_hf_folder(hf, tmp_path_factory.mktemp(kind))
    return kind, hf, folder, load_model(folder)


@pytest.fixture(scope="module")
def reference(pair: Any) -> dict[tuple[int, ...], list[int]]:
    _, hf, _, _ = pair
    prompts = shared_prefix_prompts(0, 6) + shared_prefix_prompts(1, 6)
    return {tuple(p): hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts}


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(dict(enable_prefix_cache=False), id="cache-off"),
        pytest.param(dict(), id="cache-on"),
        pytest.param(dict(chunked_prefill_size=7, max_prefill_tokens=12), id="chunked"),
        pytest.param(dict(page_size=16, num_pages=100, cascade="on"), id="page-16-cascade"),
        pytest.param(dict(num_pages=40, max_prefill_tokens=64), id="tiny-pool"),
    ],
)
def test_engine_greedy_equals_transformers(
    pair: Any, reference: dict[tuple[int, ...], list[int]], cfg: dict[str, Any]
) -> None:
    """Two waves (the second against a warm cache), invariants checked after every step."""
    _, _, _, lm = pair
    kw: dict[str, Any] = dict(page_size=4, num_pages=600)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    for wave in (0, 1):
        prompts = shared_prefix_prompts(wave, 6)
        for p, o in zip(prompts, run_checked(eng, prompts, GREEDY), strict=True):
            assert o.token_ids == reference[tuple(p)], (cfg, wave, p)
    hits = eng.stats().prefix_cache_hit_tokens
    assert (hits > 0) == eng.config.enable_prefix_cache


def test_bf16_block_routes_and_sums_as_transformers(pair: Any) -> None:
    """In bf16 (what dtype="auto" picks on a bf16 CPU) each sparse block chooses the same
    experts with the same weights as transformers' bf16 block, and its output is within bf16
    rounding of it (whole-model logits can differ more: a near tie between two experts'
    probabilities, rounded differently upstream, sends a token elsewhere)."""
    _, hf, folder, _ = pair
    lm = load_model(folder, dtype=torch.bfloat16)
    hfb = copy.deepcopy(hf).to(torch.bfloat16)  # (.to() is in place: the fixture stays fp32)
    x = torch.randn(300, lm.config.hidden_size, generator=torch.Generator().manual_seed(4))
    x = x.to(torch.bfloat16)
    checked = 0
    with torch.no_grad():
        for ours_layer, ref_layer in zip(lm.model.model.layers, hfb.model.layers, strict=True):
            ours = getattr(ours_layer, ours_layer.ffn_name)
            if not isinstance(ours, SparseMoE):
                continue
            ref = getattr(ref_layer, "mlp", None) or ref_layer.block_sparse_moe  # (GraniteMoE's)
            experts, weights = ours.route(x)
            _, ref_weights, ref_experts = (getattr(ref, "gate", None) or ref.router)(x)
            assert torch.equal(experts, ref_experts)
            assert weights.dtype == ref_weights.dtype
            assert torch.equal(weights, ref_weights)
            got, want = ours(x).float(), ref(x[None])[0].float()
            tol = 2**-7 * want.abs().max().item()  # a couple of bf16 roundings
            assert (got - want).abs().max().item() <= tol
            checked += 1
    assert checked == sum(lm.config.moe.is_sparse(i) for i in range(lm.config.num_layers)) > 0


def test_only_the_chosen_experts_run(pair: Any) -> None:
    """A decode step of one token runs top_k experts per sparse layer, no more (the others
    cost nothing), and each of them on exactly that token's row."""
    _, _, _, lm = pair
    moe = lm.config.moe
    calls: list[int] = []
    hooks = [
        expert.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
        for module in lm.model.modules()
        if isinstance(module, SparseMoE)
        for expert in module.experts
    ]
    try:
        c = lm.config
        pool = KVPool(c.num_layers, 16, 4, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
        runner = ModelRunner(lm.model, pool, backend="torch")
        runner.forward([SeqInput([5, 6, 7, 8, 9], [0, 1], 0)])
        calls.clear()
        runner.forward([SeqInput([10], [0, 1], 5)])
    finally:
        for h in hooks:
            h.remove()
    sparse = sum(moe.is_sparse(i) for i in range(c.num_layers))
    assert calls == [1] * (moe.top_k * sparse)


def test_active_width_sets_the_prefill_cost() -> None:
    """The prefill budget weighs a token by the experts it runs through, not all of them."""
    base = dict(
        architecture="Qwen2MoeForCausalLM", vocab_size=100, hidden_size=64,
        intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=128,
    )  # fmt: skip
    moe = MoEConfig(num_experts=60, top_k=4, expert_size=32, shared_expert_size=80, sparse_step=2)
    cfg = ModelConfig(**base, moe=moe)
    # layers 1 and 3 sparse (4 * 32 + 80 = 208 wide), 0 and 2 dense (96)
    assert cfg.active_intermediate_size == (2 * 208 + 2 * 96) / 4
    dense = ModelConfig(**{**base, "architecture": "Qwen2ForCausalLM"})
    assert dense.active_intermediate_size == 96
    h, q, kv = 64, 64, 32
    assert attention_cost_ratio(cfg) == (2 * h * q + 2 * h * kv + 3 * h * 152) / (2 * q)
    # a step's fixed cost scales with the weights stored per weight a token runs through
    attn = 2 * h * q + 2 * h * kv
    stored = (2 * (60 * 32 + 80) + 2 * 96) / 4
    assert weights_per_active(cfg) == (attn + 3 * h * stored) / (attn + 3 * h * 152)
    assert weights_per_active(dense) == 1.0


def test_config_errors_name_the_field(pair: Any, tmp_path: Path) -> None:
    kind, _, folder, _ = pair
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_experts_per_tok": ...}, r"field 'num_experts_per_tok': missing"),
        ({"num_experts_per_tok": 99}, r"'num_experts_per_tok': 99 exceeds the \d+ experts"),
        ({"num_experts_per_tok": 0}, r"'num_experts_per_tok': must be a positive integer"),
    ]
    if kind in ("qwen2_moe", "qwen3_moe"):
        cases += [
            ({"moe_intermediate_size": ...}, r"'moe_intermediate_size': missing"),
            ({"mlp_only_layers": [0, "x"]}, r"'mlp_only_layers': must be a list of layer"),
            ({"decoder_sparse_step": 0}, r"'decoder_sparse_step': must be a positive"),
        ]
    if kind == "qwen2_moe":
        cases.append(({"shared_expert_intermediate_size": -1}, r"must be an int >= 0"))
    for changes, pattern in cases:
        dst = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folder, dst)
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in changes.items():
            if value is ...:
                cfg.pop(key)
            else:
                cfg[key] = value
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=pattern):
            load_model(dst)


def test_model_config_needs_moe_exactly_for_moe_architectures() -> None:
    base = dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    with pytest.raises(ValueError, match="MixtralForCausalLM needs an MoEConfig"):
        ModelConfig(architecture="MixtralForCausalLM", **base)
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no MoEConfig"):
        ModelConfig(architecture="LlamaForCausalLM", **base, moe=MoEConfig(4, 2, 32))
    with pytest.raises(ValueError, match=r"top_k \(5\) exceeds num_experts \(4\)"):
        MoEConfig(4, 5, 32)
    with pytest.raises(ValueError, match="style must be 'qwen', 'mixtral' or 'granite'"):
        MoEConfig(4, 2, 32, style="deepseek")


def test_lora_on_attention_and_dense_layers(tmp_path: Path) -> None:
    """Qwen3-MoE (layer 1 dense): a PEFT adapter on q/v matches PEFT; MLP modules exist on the
    dense layer only, and adapters on experts (PEFT's, on transformers' fused expert weights,
    or one naming an expert's module) are refused naming the problem."""
    hf = build_hf_model("qwen3_moe", seed=30)
    lm = load_model(save_hf_folder(hf, tmp_path / "base"))
    c = lm.config
    ref = make_peft_adapter(hf, tmp_path / "a", seed=5, target_modules=["q_proj", "v_proj"])
    adapter = load_lora_adapter(tmp_path / "a", c)
    assert sorted(adapter.factors) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    runner = ModelRunner(
        lm.model, KVPool(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, c.dtype, "cpu"),
        backend="torch",
    )  # fmt: skip
    slot = runner.loras.add(adapter)
    ids = [5, 17, 33, 9, 120, 7, 64, 250, 3, 11, 42]
    got = runner.forward([SeqInput(ids, [0, 1, 2], 0, slot)], all_logits=True)
    want = peft_logits(ref, ids)
    assert (got - want).abs().max().item() < 1e-4
    assert (want - peft_logits(hf, ids)).abs().max().item() > 0.1  # the adapter matters
    # PEFT maps down_proj onto the fused experts of the sparse layer: refused
    make_peft_adapter(hf, tmp_path / "e", seed=6, target_modules=["down_proj"])
    with pytest.raises(ModelLoadError, match="mixture-of-experts layer's experts or router"):
        load_lora_adapter(tmp_path / "e", c)
    # a random adapter of every module skips the sparse layer's MLP modules, and runs
    folder = save_random_adapter(c, tmp_path / "r")
    factors = load_lora_adapter(folder, c).factors
    assert (0, "gate_proj") not in factors and (1, "gate_proj") in factors
    slot2 = runner.loras.add(load_lora_adapter(folder, c))
    adapted = runner.forward([SeqInput(ids, [3, 4, 5], 0, slot2)], all_logits=True)
    assert (adapted - peft_logits(hf, ids)).abs().max().item() > 0.1
    # naming an MLP module of the sparse layer, or an expert's, is refused
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    a = torch.zeros(8, c.hidden_size)
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = a
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="layer 0 is a mixture-of-experts layer: it has no"):
        load_lora_adapter(folder, c)
    del tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]
    tensors["base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight"] = a
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="mixture-of-experts layer's experts or router"):
        load_lora_adapter(folder, c)


def test_weight_update_swaps_experts(pair: Any, tmp_path: Path) -> None:
    """update_weights from another checkpoint of the same shape: outputs become the new
    model's (every expert's weights replaced, no KV of the old weights reused)."""
    kind, _, folder, _ = pair
    new_hf = build_hf_model(kind, seed=99)
    new = save_hf_folder(new_hf, tmp_path / "new")
    eng = Engine(load_model(folder), page_size=4, num_pages=300)  # its own copy of the weights
    prompts = shared_prefix_prompts(2, 4)
    before = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    eng.update_weights(new)
    after = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    assert after == [hf_greedy(new_hf, p, GREEDY.max_tokens) for p in prompts]
    assert after != before
    eng.check_invariants()
