"""What bench/'s scripts share, so that each states only its workload and its report.

Importing it puts this checkout's radixkv first on ``sys.path`` (not an installed one). Parts:

* ``record``: bench/results/ paths, the machine and date lines, versions, writing the JSON;
* ``rounds``: systems timed in rotated rounds (a slow spell of a shared machine hits each
  alike), medians;
* ``compare``: greedy outputs compared token by token;
* ``random_checkpoint``: the random checkpoint every peer runs (a seeded Llama, or another
  architecture, saved as a Hugging Face folder);
* ``gguf``: GGUF files of it, made by llama.cpp's own converter;
* ``systems``: the :class:`Workload` and :class:`System` of the peer comparisons, radixkv's runner;
* ``hf``: transformers as a peer (models, greedy ``generate``, the shared-prefix recipes);
* ``llamacpp``: llama.cpp as a peer (llama-cpp-python's ``Llama`` and its server);
* ``cpu_peak``: the CPU's matmul peak and a prefill's share of it.

Names are resolved on first use (``peerkit.write_json`` imports ``record`` alone), so a torch-free
benchmark (bench_cache.py) stays torch-free; the peers themselves (transformers, llama_cpp, peft)
are imported inside the functions that run them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .record import ROOT

if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # this checkout's radixkv, not whichever is installed

_EXPORTS: dict[str, tuple[str, ...]] = {
    "random_checkpoint": ("FIRST_ID", "LLAMA", "MODEL", "SEED", "Checkpoint", "build_checkpoint",
                   "checkpoint", "random_ids"),
    "compare": ("agreement", "identical", "same_count"),
    "cpu_peak": ("cpu_limit",),
    "gguf": ("add_gguf_arguments", "convert", "converter_from", "extract_converter",
             "f32_checkpoint", "fetch_converter"),
    "hf": ("hf_generate", "hf_model", "quiet", "tiny_hf_model", "transformers_systems"),
    "llamacpp": ("LlamaCppServer", "free_port", "llama_cpp_system", "open_llama"),
    "record": ("CACHE", "RESULTS_DIR", "ROOT", "cpu_name", "load_average", "machine_dict",
               "machine_line", "pip_download", "print_rows", "results_path", "utc_now", "versions",
               "write_json"),
    "rounds": ("add_round_arguments", "medians", "rotated_rounds", "rotated_rounds_all",
               "rounds_of", "timed"),
    "systems": ("System", "Workload", "greedy", "peer_engine", "radixkv_system"),
}  # fmt: skip
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'peerkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # resolved once
    return value
