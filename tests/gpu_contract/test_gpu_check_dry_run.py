"""bench/gpu_check.py's correctness sections, dry-run on the CPU through the stand-ins: its
batches, cascade plans and model steps are valid FlashInfer calls, agree with the torch
reference under the documented maths, and use only the attention shapes of
``gpu_check.kernel_variants()`` (the ones the GPU kit compiles), so the lent GPU's minutes go
to kernels, not to bugs in the script."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import flashinfer as real_flashinfer
import pytest
import torch
from standins import FakeFlashInfer

from radixkv.attention import flashinfer_backend as fib

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    stand_in = FakeFlashInfer(real_flashinfer, "cpu")
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr(fib, "_require_cuda", lambda device, what: None)
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    return stand_in


def _shapes_used(fake: FakeFlashInfer) -> set[gpu_check.Variant]:
    """Every planned kernel variant: shape, and the two switches FlashInfer compiles apart
    (``window_left >= 0``: sliding window; ``logits_soft_cap > 0``: soft cap)."""
    used = set()
    for c in fake.recorder.calls:
        if c.name.endswith(".plan"):
            a = c.args
            d = a.get("head_dim_qk", a.get("head_dim"))
            window = a.get("window_left", -1) >= 0
            softcap = (a.get("logits_soft_cap") or 0.0) > 0
            used.add((a["q_data_type"], a["num_qo_heads"], a["num_kv_heads"], d, window, softcap))
    return used


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_paged_section(fake: FakeFlashInfer, kind: str) -> None:
    row = gpu_check.check_paged(kind, torch.bfloat16, 16)
    assert row["ok"], row
    assert _shapes_used(fake) <= set(gpu_check.kernel_variants())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["two_level", "three_level", "three_partial"])
def test_cascade_section(fake: FakeFlashInfer, case: str, page_size: int) -> None:
    row = gpu_check.check_cascade(case, torch.float16, page_size)
    assert row["ok"], row
    assert row["levels"] == (2 if case == "two_level" else 3)
    assert row["mode"] == ("per_level" if case == "three_partial" else "multi")
    assert _shapes_used(fake) <= set(gpu_check.kernel_variants())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(gpu_check.WINDOW_CASES))
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_window_section(fake: FakeFlashInfer, case: str, kind: str, page_size: int) -> None:
    row = gpu_check.check_window(case, kind, page_size)
    assert row["ok"], row
    used = _shapes_used(fake)
    assert used <= set(gpu_check.kernel_variants())
    softcap = case == "window_softcap"
    assert {(v[4], v[5]) for v in used} == {(False, softcap), (True, softcap)}  # both layers


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_hybrid_section(fake: FakeFlashInfer, kind: str) -> None:
    row = gpu_check.check_hybrid(kind)
    assert row["ok"], row
    assert _shapes_used(fake) <= set(gpu_check.kernel_variants())


def test_cascade_timing_section(fake: FakeFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    def wall_ms(fn, repeats: int = 1) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(gpu_check, "_time_cuda", wall_ms)
    row = gpu_check.time_cascade(512, batch=8)
    assert row["ok"], row
    assert row["kv_read_ratio"] > 1


def test_tiny_model_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_tiny_model()
    assert row["ok"], row
    assert _shapes_used(fake) <= set(gpu_check.kernel_variants())


def test_sampling_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_sampling("cpu")
    assert row["ok"], row
    assert row["adjust_max_abs_diff"] == 0.0  # the same device here: bit for bit


def test_prompt_logprobs_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_prompt_logprobs("cpu")
    assert row["ok"], row
    assert row["entries"] == row["tokens"] and row["cached_with_start"] > 0


def test_speculative_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_speculative("cpu")
    assert row["ok"], row
    assert row["common_prefix_fraction"] > 0.9


def test_lora_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_lora("cpu")
    assert row["ok"], row
    assert row["max_abs_diff"] == 0.0 and row["adapter_moves_logits_by"] > 1.0
    assert row["namespaces"] == 2


def test_moe_section(fake: FakeFlashInfer) -> None:
    row = gpu_check.check_moe("cpu")
    assert row["ok"], row
    assert row["clear_argmax_mismatches"] == 0 and row["engine_hit_tokens"] > 0
    assert _shapes_used(fake) <= set(gpu_check.kernel_variants())


def test_table_renders() -> None:
    result = {"ok": False, "device": "x", "paged": [{"ok": True, "max_abs_diff": 1e-3}],
              "cascade": {"ok": False, "error": "boom"}, "timings": {"error": "boom"}}  # fmt: skip
    text = gpu_check._table(result)
    assert "FAILED" in text and "| paged | 1 | 0 |" in text and "| cascade | error" in text
