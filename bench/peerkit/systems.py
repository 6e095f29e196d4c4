"""A system under comparison and radixkv's own runner: each peer runs a :class:`Workload` of
token-id prompts to greedy output ids, exactly ``new_tokens`` each (EOS ignored), so every
system does the same work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: int
    shared_prefix: int  # tokens every prompt shares (0: none)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class System:
    """One way to run a workload: ``run`` returns each prompt's new token ids."""

    name: str
    engine: str  # radixkv, transformers, llama.cpp
    precision: str  # float32, bfloat16, q8_0
    run: Callable[[Workload], list[list[int]]]
    applies: Callable[[Workload], bool] = field(default=lambda w: True)
    note: str = ""


def peer_engine(folder: Path, dtype: str, max_tokens: int, num_seqs: int, **kw: Any) -> Any:
    """radixkv's Engine on ``folder`` as the peer scripts run it: CPU, pages of 16, room for
    ``num_seqs`` requests of ``max_tokens`` tokens all running at once (``kw``: more
    EngineConfig fields)."""
    from radixkv.engine.engine import Engine
    from radixkv.pages import pages_for

    page = 16
    return Engine(
        str(folder),
        dtype=dtype,
        device="cpu",
        page_size=page,
        num_pages=num_seqs * (pages_for(max_tokens, page) + 1) + 8,
        max_running_requests=num_seqs,
        **kw,
    )


def greedy(new_tokens: int) -> Any:
    """Greedy sampling of exactly ``new_tokens`` tokens (EOS ignored), radixkv's side of the
    peers' settings."""
    from radixkv.engine.params import SamplingParams

    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def radixkv_system(folder: Path, dtype: str, max_tokens: int, num_seqs: int) -> System:
    engine = peer_engine(folder, dtype, max_tokens, num_seqs)

    def run(w: Workload) -> list[list[int]]:
        engine.reset_prefix_cache()  # every run starts cold, like the peers'
        outs = engine.generate(w.prompts, greedy(w.new_tokens), use_tqdm=False)
        engine.check_invariants()
        return [list(o.token_ids) for o in outs]

    return System(f"radixkv {dtype}", "radixkv", dtype, run, note="Engine, prefix cache on")
