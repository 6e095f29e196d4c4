"""The extension points are tables: attention backends, storage URL schemes, model families and
scheduling policies are looked up by name; an unknown name's error lists the known ones, and a
row registered from outside is found by the same code paths as the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixkv.attention.names import ATTENTION_BACKENDS
from radixkv.attention.registry import choose_backend, get_backend
from radixkv.attention.torch_backend import TorchAttention
from radixkv.cache.storage import FileStorage, StorageBackend, open_storage
from radixkv.cache.storage.url import STORAGE_SCHEMES
from radixkv.engine.config import EngineConfig
from radixkv.engine.names import SCHEDULE_POLICIES
from radixkv.engine.schedule_policy import fcfs, lpm
from radixkv.kv.kv_pool import KVPool
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.families import MODEL_FAMILIES, ArchFlags, ModelFamily, family_of
from radixkv.model.llama import LlamaForCausalLM
from radixkv.model.loader import model_class
from radixkv.name_table import NameTable, import_target


# ---------------------------------------------------------------------- NameTable itself
def test_name_table_lists_known_names_on_a_miss_and_imports_lazily() -> None:
    table: NameTable[object] = NameTable("widget", {"path": "pathlib:Path"}, extra=("auto",))
    assert list(table) == ["auto", "path"] and "auto" in table and "path" in table
    assert "nope" not in table and 3 not in table and len(table) == 2
    assert table.get("path") is Path and table["path"] is Path  # imported on first get
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; known: auto, path"):
        table.get("nope")
    with pytest.raises(ValueError, match="unknown widget 'auto'"):
        table.get("auto")  # an extra name is a valid choice, not a row
    assert table.check("auto") == "auto"
    with pytest.raises(ValueError, match="known: auto, path"):
        table.check(None)


def test_name_table_refuses_bad_rows() -> None:
    table: NameTable[object] = NameTable("widget", {"a": "os:sep"}, extra=("auto",))
    for name in ("a", "auto"):
        with pytest.raises(ValueError, match="already registered"):
            table.register(name, object())
    with pytest.raises(ValueError, match="non-empty string"):
        table.register("", object())
    with pytest.raises(ValueError, match=r"package\.module:attribute"):
        table.register("b", "os.sep")
    table.register("a", "os:linesep", replace=True)
    table.unregister("a")
    assert list(table) == ["auto"]
    with pytest.raises(ValueError, match="unknown widget 'a'"):
        table.unregister("a")


# ---------------------------------------------------------------------- attention backends
class _CountingAttention(TorchAttention):
    built = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def test_backend() -> Iterator[str]:
    ATTENTION_BACKENDS.register("counting", _CountingAttention)
    yield "counting"
    ATTENTION_BACKENDS.unregister("counting")


def _pool() -> KVPool:
    return KVPool(
        num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=4,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip


def test_attention_backend_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; known: auto, torch"):
        get_backend("nope", _pool(), num_qo_heads=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="flashinfer"):
        EngineConfig(attention_backend="nope")


def test_a_registered_attention_backend_is_built_and_accepted(test_backend: str) -> None:
    pool = _pool()
    assert choose_backend(test_backend, pool).name == test_backend
    before = _CountingAttention.built
    backend = get_backend(test_backend, pool, num_qo_heads=1, num_kv_heads=1, head_dim=4)
    assert isinstance(backend, _CountingAttention) and _CountingAttention.built == before + 1
    assert EngineConfig(attention_backend=test_backend).attention_backend == test_backend
    assert isinstance(get_backend("auto", pool, num_qo_heads=1, num_kv_heads=1, head_dim=4),
                      TorchAttention)  # fmt: skip


# ---------------------------------------------------------------------- storage URL schemes
def test_storage_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scheme 's3'; known: file, redis, .*unix"):
        open_storage("s3://bucket/kv")


def test_a_registered_storage_scheme_is_opened(tmp_path: Path) -> None:
    seen: list[tuple[str, float]] = []

    def open_mem(url: str, timeout: float) -> StorageBackend:
        seen.append((url, timeout))
        return FileStorage(tmp_path / "mem")

    STORAGE_SCHEMES.register("mem", open_mem)
    try:
        backend = open_storage("  MEM://x  ", timeout=2.5)
    finally:
        STORAGE_SCHEMES.unregister("mem")
    assert isinstance(backend, FileStorage) and seen == [("MEM://x", 2.5)]
    with pytest.raises(ValueError, match="unknown scheme 'mem'"):
        open_storage("mem://x")


# ---------------------------------------------------------------------- model families
def _config(arch: str) -> ModelConfig:
    return ModelConfig(
        architecture=arch, vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip


def test_every_built_in_architecture_has_its_family_class() -> None:
    for name in MODEL_FAMILIES:
        family = MODEL_FAMILIES.get(name)
        cls = import_target(family.model)
        assert all(family_of(arch) is family for arch in family.architectures)
        dense = next(a for a in family.architectures if "Moe" not in a and "Mixtral" not in a)
        assert model_class(_config(dense)) is cls  # the loader's answer is the row's class
    assert model_class(_config("Qwen2ForCausalLM")) is LlamaForCausalLM


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture 'Nope'; supported: .*Llama"):
        _config("Nope")
    with pytest.raises(ModelLoadError, match=r"supported: .*Gemma2ForCausalLM"):
        ModelConfig.from_hf({"architectures": ["Nope"]})


class OtherFamilyLM(LlamaForCausalLM):
    """A family of its own for the test (the Llama computation under another class)."""


def test_fields_of_a_test_family(tmp_path: Path) -> None:
    """A family row alone makes its architecture parse (with the row's flags and config
    readings) and build its class."""
    row = ModelFamily(
        f"{__name__}:OtherFamilyLM",
        {"TestFamilyForCausalLM": ArchFlags(qkv_bias=True)},
        tie_word_embeddings=True,
        norm_eps_field="layer_norm_eps",
        norm_eps_default=1e-3,
    )
    MODEL_FAMILIES.register("test-family", row)
    try:
        hf = {"architectures": ["TestFamilyForCausalLM"], "vocab_size": 32, "hidden_size": 16}
        hf |= {"intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        cfg = ModelConfig.from_hf(hf)
        assert cfg.qkv_bias and not cfg.qk_norm and cfg.tie_word_embeddings
        assert cfg.rms_norm_eps == 1e-3
        assert model_class(cfg) is OtherFamilyLM
        with pytest.raises(ValueError, match="in the test-family and clash families"):
            MODEL_FAMILIES.register("clash", row)
            family_of("TestFamilyForCausalLM")
    finally:
        MODEL_FAMILIES.unregister("test-family")
        if "clash" in MODEL_FAMILIES:
            MODEL_FAMILIES.unregister("clash")
    with pytest.raises(ValueError, match="unsupported architecture 'TestFamilyForCausalLM'"):
        family_of("TestFamilyForCausalLM")


# ---------------------------------------------------------------------- scheduling policies
def test_schedule_policies_are_a_table() -> None:
    assert SCHEDULE_POLICIES.get("lpm") is lpm and SCHEDULE_POLICIES["fcfs"] is fcfs
    with pytest.raises(ValueError, match="unknown schedule policy 'nope'; known: lpm, fcfs"):
        SCHEDULE_POLICIES.get("nope")
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        EngineConfig(schedule_policy="nope")
