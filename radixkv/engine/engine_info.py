"""EngineInfo: what an engine is (its model, limits and settings), as a front end shows it.

A plain snapshot, safe to read from any thread: a server answers ``/v1/models`` or
``/server_info`` from it without touching the engine, which only its own thread may
(``AsyncEngine``). Only ``weight_version`` changes while the engine serves (a weight update
takes a new snapshot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from radixkv.engine.engine import Engine


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``model``: the name or path it is served under; ``tokenizer``: where the tokenizer came
    from when not the model's (None); ``max_context``: prompt + output tokens a request may
    hold; ``num_pages`` of ``page_size`` tokens: the KV pool; ``kv_device``: where KV pages
    live (``"cpu"``, ``"cuda:0"``); ``dtype``: what the model computes in; the other fields
    are the engine config's of the same names (``attention_backend`` as "auto" resolved)."""

    model: str
    architecture: str
    tokenizer: str | None
    max_context: int
    vocab_size: int
    page_size: int
    num_pages: int
    max_running_requests: int
    chunked_prefill_size: int | None
    schedule_policy: str
    enable_prefix_cache: bool
    attention_backend: str
    kv_device: str
    dtype: str
    kv_cache_dtype: str
    weight_version: str

    @property
    def on_gpu(self) -> bool:
        """KV pages live in accelerator memory (a CUDA device)."""
        return self.kv_device.startswith("cuda")

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        """``engine`` described now (call it on the thread that drives the engine)."""
        cfg = engine.config
        kv = engine.kv_pool
        return cls(
            model=str(engine.model.name),
            architecture=engine.model.config.architecture,
            tokenizer=None if cfg.tokenizer is None else str(cfg.tokenizer),
            max_context=engine.max_context,
            vocab_size=engine.vocab_size,
            page_size=engine.page_size,
            num_pages=engine.pool.num_pages,
            max_running_requests=cfg.max_running_requests,
            chunked_prefill_size=cfg.chunked_prefill_size,
            schedule_policy=cfg.schedule_policy,
            enable_prefix_cache=cfg.enable_prefix_cache,
            attention_backend=engine.backend_choice.name,
            kv_device=str(kv.device),
            dtype=str(kv.compute_dtype).removeprefix("torch."),
            kv_cache_dtype=cfg.kv_cache_dtype,
            weight_version=engine.weight_version,
        )
