"""Startup logging: the engine's summary line, the attention backend it chose and why, the
warning when "auto" leaves a CUDA pool on the torch kernels (simulated: no GPU here), the
server's log config, and the progress bar's tokens per second."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from radixkv import onednn
from radixkv.attention import registry
from radixkv.attention.registry import choose_backend
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.kv_pool import KVPool
from radixkv.server.cli import log_config

MODEL = "radixkv-tiny-random"
ENGINE_LOGGER = "radixkv.engine.engine"


def _pool(dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(1, 4, 4, 1, 8, dtype, torch.device("cpu"))


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_startup_summary_names_what_was_built(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.INFO, logger=ENGINE_LOGGER):
        eng = Engine(MODEL, num_pages=48, page_size=8, eviction_policy="lfu")
    (line,) = [m for m in _messages(caplog, logging.INFO) if m.startswith("radixkv engine:")]
    kv = eng.kv_pool
    mib = kv.num_pages * kv.bytes_per_page / 2**20
    for part in (
        "model radixkv-tiny-random (LlamaForCausalLM, 2 layers, max context 16384 tokens)",
        "on cpu in float32",
        "attention torch (auto: the KV pool is on cpu (flashinfer needs CUDA))",
        f"KV pool 48 pages x 8 tokens = 384 tokens ({mib:.1f} MiB, float32)",
        "prefix cache on (lfu eviction)",
    ):
        assert part in line, (part, line)
    assert f"), prefill by {eng.runner.attn.prefill_path}; KV pool" in line
    packed = eng.runner.packed_weight_bytes  # the second copy packing costs, said up front
    if onednn.packing_available(torch.float32):
        assert packed > 0 and line.endswith(
            f"prefix cache on (lfu eviction); linear weights packed for oneDNN "
            f"(+{packed / 2**20:.1f} MiB; RADIXKV_PREPACK=0 turns it off)"
        )
    assert not _messages(caplog, logging.WARNING)
    caplog.clear()
    monkeypatch.setattr(onednn, "PREPACK", False)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOGGER):
        eng = Engine(MODEL, num_pages=8, enable_prefix_cache=False, attention_backend="torch")
    (line,) = _messages(caplog, logging.INFO)
    assert "attention torch (requested)" in line and line.endswith("prefix cache off")
    assert eng.runner.packed_weight_bytes == 0


def test_backend_choice_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_backend("torch", _pool()).reason == "requested"
    assert choose_backend("flashinfer", _pool()).name == "flashinfer"  # explicit: kept
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("xformers", _pool())
    cpu = choose_backend("auto", _pool(torch.bfloat16))
    assert (cpu.name, cpu.fallback) == ("torch", False)  # a CPU has nothing faster
    monkeypatch.setattr(registry, "pool_device_type", lambda pool: "cuda")
    monkeypatch.setattr(registry, "flashinfer_available", lambda: True)
    fi = choose_backend("auto", _pool(torch.bfloat16))
    assert (fi.name, fi.fallback) == ("flashinfer", False)
    assert fi.reason == "auto: CUDA pool in bfloat16 and flashinfer is installed"
    fp32 = choose_backend("auto", _pool(torch.float32))
    assert (fp32.name, fp32.fallback) == ("torch", True) and "no float32 kernels" in fp32.reason
    fp8 = KVPool(1, 4, 4, 1, 8, torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    fp8_choice = choose_backend("auto", fp8)  # FlashInfer's fp8 kernels are not in the kit
    assert (fp8_choice.name, fp8_choice.fallback) == ("torch", True)
    assert "pages store float8_e4m3fn (kv_cache_dtype)" in fp8_choice.reason
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    missing = choose_backend("auto", _pool(torch.float16))
    assert (missing.name, missing.fallback) == ("torch", True)
    assert "flashinfer is not installed" in missing.reason
    assert registry.resolve_backend_name("auto", _pool(torch.float16)) == "torch"


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [(None, "flashinfer has no float32 kernels"), ("bfloat16", "flashinfer is not installed")],
)
def test_auto_falling_back_to_torch_on_cuda_warns(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    dtype: str | None,
    reason: str,
) -> None:
    """The pool is on the CPU; the registry is told it is on CUDA without flashinfer."""
    monkeypatch.setattr(registry, "pool_device_type", lambda pool: "cuda")
    monkeypatch.setattr(registry, "flashinfer_available", lambda: False)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOGGER):
        eng = Engine(MODEL, num_pages=16, dtype=dtype)
    (warning,) = _messages(caplog, logging.WARNING)
    assert warning.startswith("attention backend auto fell back to the torch kernels")
    assert reason in warning and "--attention-backend torch" in warning
    assert eng.runner.backend_name == "torch" and eng.backend_choice.fallback
    out = eng.generate("def f(", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2  # the fallback serves
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=ENGINE_LOGGER):
        Engine(MODEL, num_pages=16, attention_backend="torch")  # chosen on purpose: no warning
    assert not _messages(caplog, logging.WARNING)


def test_server_log_config_wires_the_radixkv_loggers() -> None:
    for level, want in (("info", "INFO"), ("warning", "WARNING"), ("trace", "DEBUG")):
        cfg = log_config(level)
        assert cfg["loggers"]["radixkv"] == {
            "handlers": ["default"],
            "level": want,
            "propagate": False,
        }
        assert "default" in cfg["handlers"] and "uvicorn.error" in cfg["loggers"]
    import uvicorn.config

    assert "radixkv" not in uvicorn.config.LOGGING_CONFIG["loggers"]  # a copy was changed


def test_progress_bar_shows_tokens_per_second(capsys: pytest.CaptureFixture[str]) -> None:
    eng = Engine(MODEL, num_pages=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = eng.generate(["def f(", "class A:", "import os"], params, use_tqdm=True)
    assert all(len(o.token_ids) == 8 for o in outs)
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    m = re.search(r"3/3 .*in ([\d,]+) tok/s, out ([\d,]+) tok/s", last)
    assert m, last
    assert int(m.group(1).replace(",", "")) > 0 and int(m.group(2).replace(",", "")) > 0
    eng.generate("x", params, use_tqdm=False)
    assert "tok/s" not in capsys.readouterr().err
