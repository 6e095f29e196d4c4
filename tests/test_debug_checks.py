"""Per-step re-validation in the model runner and the attention backends is debug-only."""

from __future__ import annotations

import pytest

from radixkv.debug import ENV_VAR, debug_checks_enabled
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner, SeqInput


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


def _pool(lm: LoadedModel) -> KVPool:
    c = lm.config
    return KVPool(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, c.dtype, "cpu")


def test_the_suite_runs_with_debug_checks() -> None:
    assert debug_checks_enabled()  # tests/conftest.py


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("1", True), ("yes", True)])
def test_env_var_sets_the_default(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    runner = ModelRunner(tiny.model, _pool(tiny))
    assert runner.check_inputs is on and runner.attn.check_layouts is on


def test_explicit_flag_wins_and_reaches_the_backend(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny.model, _pool(tiny), check_inputs=False)
    assert not runner.check_inputs and not runner.attn.check_layouts
    # the engine's batches are valid by construction; a valid one runs either way
    assert runner.forward([SeqInput([1, 2, 3], [0], 0)]).shape[0] == 1
    checked = ModelRunner(tiny.model, _pool(tiny), check_inputs=True)
    with pytest.raises(ValueError, match="token id"):
        checked.forward([SeqInput([tiny.config.vocab_size], [0], 0)])
    with pytest.raises(ValueError, match="page table has 1"):
        checked.forward([SeqInput(list(range(20)), [0], 0)])
