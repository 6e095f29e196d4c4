"""radixkv against what its users would otherwise run, side by side in one process and one run.

One checkpoint for everyone: a random Llama (hidden 512, 4 layers, 8 heads / 4 KV heads of 64,
SwiGLU 1536, vocabulary 32,000), built with transformers and saved as a Hugging Face folder
in float32 (safetensors, a Llama-style byte-fallback tokenizer.json). The peers:

* ``transformers`` (sdpa attention), two ways: one batched ``generate`` over all prompts, and the
  shared-prefix recipe its docs give: prefill the prefix once into a ``DynamicCache``, then
  ``generate`` each request from a ``copy.deepcopy`` of it (also timed with the copy expanded to
  the whole batch, one batched ``generate``: whichever is faster is "transformers best");
* llama.cpp through ``llama-cpp-python`` (built from source on this machine), on GGUF files made
  from the same folder by the converter in llama.cpp's own source (``convert_hf_to_gguf.py``):
  f32, bf16 and q8_0. ``Llama.generate`` runs one sequence at a time and reuses the longest
  prefix its context shares with the previous request, which is its shared-prefix recipe.
  The KV cache is kept in the weights' precision (f32, bf16; llama.cpp's default f16 for q8_0).

Every system runs at both precisions where it has them: float32, and bfloat16 (radixkv's
``dtype="bfloat16"``, transformers' model in bf16, llama.cpp's bf16 GGUF). Two workloads, all
requests submitted at once, greedy, exactly ``--new`` tokens each (EOS ignored):

* ``shared_prefix``: 32 requests, a 2,048-token shared prefix + 64 unique tokens, 32 new tokens;
* ``no_sharing``: 32 requests of 2,112 unique tokens, 32 new tokens.

Timing: wall clock from the prompts' token ids to all output ids (radixkv's prefix cache is
emptied before each run; model loading and GGUF conversion are outside). ``--runs`` rounds
(default 3); in each round every (workload, system) runs once, in an order shuffled per round,
so a slow spell of a shared machine hits every system alike; the table gives the median of the
rounds (and every round's time in the JSON). Greedy outputs are compared token by token with
transformers' batched ``generate`` at the same precision (and, for bf16 and q8_0, with the float32
reference too): requests whose outputs are identical, and the mean number of leading tokens that
agree.

Close to the CPU's limit (``cpu_limit``): in the same run, the machine's matmul peak (the best of
square and model-shaped matmuls, fp32 and bf16) and radixkv-tiny's 4,096-token prefill in fp32
and bf16 as a share of it, interleaved, best of ``--peak-repeats``.

Writes bench/results/bench_peers.json. Usage::

    python bench/bench_peers.py [--quick] [--runs 3] [--workloads shared_prefix,no_sharing]
        [--systems radixkv,transformers,llama.cpp] [--converter PATH | --fetch-converter]

The llama.cpp part needs ``llama-cpp-python``, ``gguf`` and ``sentencepiece`` (the converter
imports it) and the converter script: ``--converter`` names convert_hf_to_gguf.py inside a
llama.cpp source tree; ``--fetch-converter`` downloads the sdist of the installed
llama-cpp-python with pip and takes the converter from its vendored llama.cpp (``nox -s
bench_peers`` does all of it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_peers.json"
CACHE = ROOT / "bench" / ".cache" / "peers"

MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEED = 17
FIRST_ID = 3  # ids 0-2 are <unk>, <s>, </s>: prompts use the rest


# ---- the checkpoint ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A random checkpoint every peer runs: transformers' config and model classes (names in
    ``transformers``) with the config's fields, and the tag its files are cached under."""

    tag: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    # (module, class) of llama.cpp's converter for this architecture when that class would read
    # the vocabulary as its family's own tokenizer (Qwen's GPT-2 BPE, recognised by a hash of
    # known pre-tokenizers): it is made to read ours, the Llama-style one, as LlamaModel does
    vocab_as_llama: tuple[str, str] | None = None


LLAMA = Checkpoint(f"llama-h512-l4-v32000-s{SEED}", "LlamaConfig", "LlamaForCausalLM", MODEL)


def checkpoint(cache: Path, ckpt: Checkpoint = LLAMA) -> Path:
    """The checkpoint folder under ``cache`` (built when missing), named by its tag: the other
    peer scripts share it."""
    return build_checkpoint(cache / ckpt.tag, ckpt)


def build_checkpoint(folder: Path, ckpt: Checkpoint = LLAMA) -> Path:
    """The random model saved as a HF folder (fp32 safetensors + tokenizer files); reused when
    ``folder`` already holds it."""
    marker = folder / "radixkv_bench.json"
    if marker.is_file() and json.loads(marker.read_text()).get("tag") == ckpt.tag:
        return folder
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = getattr(transformers, ckpt.config_class)(**ckpt.config)
    model = getattr(transformers, ckpt.model_class)(cfg).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # unit-variance outputs for unit-variance inputs: logits spread, few ties
                # (weights [out, in], or an MoE's experts stacked [E, out, in]: by fan-in)
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder, ckpt.config["vocab_size"])
    marker.write_text(json.dumps({"tag": ckpt.tag, "config": ckpt.config}))
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A Llama-style tokenizer.json (BPE with byte fallback, "▁" for spaces) of exactly
    ``vocab_size`` tokens: specials, the 256 byte tokens, then single characters. The benchmark
    feeds token ids, so only its shape matters: llama.cpp's converter reads it as a Llama vocab."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁"]
    chars = [chr(c) for c in range(33, 127)]
    for lo, hi in ((0x4E00, 0xA000), (0x3400, 0x4DC0), (0xAC00, 0xD7A4)):
        chars.extend(chr(c) for c in range(lo, hi))
    tokens += chars[: vocab_size - len(tokens)]
    assert len(tokens) == vocab_size
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
            }
        )
    )


# ---- GGUF ----------------------------------------------------------------------------------------
def fetch_converter(dest: Path) -> Path:
    """convert_hf_to_gguf.py (and its ``conversion`` package) from the sdist of the installed
    llama-cpp-python, downloaded with pip into ``dest`` (see :func:`extract_converter`)."""
    import llama_cpp

    version = llama_cpp.__version__
    out = dest / f"llama.cpp-{version}"
    script = out / "convert_hf_to_gguf.py"
    if script.is_file() and (out / "gguf-py" / "gguf").is_dir():
        return script
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp],
            check=True,
        )  # fmt: skip
        return extract_converter(next(Path(tmp).glob("llama_cpp_python-*.tar.gz")), out)


def extract_converter(sdist: Path, out: Path) -> Path:
    """The converter of a llama-cpp-python sdist's vendored llama.cpp, extracted into ``out``:
    convert_hf_to_gguf.py, its ``conversion`` package and the ``gguf-py`` beside them, which the
    converter puts ahead of an installed gguf (PyPI's release of the same version number can
    lack what the converter uses, e.g. ``gguf.LazyChunkedTensor``). Returns the script."""
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(wanted)
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(out, members=members, filter="data")
    script = out / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def convert(
    folder: Path,
    converter: Path,
    outtype: str,
    dest: Path,
    tag: str = LLAMA.tag,
    vocab_as_llama: tuple[str, str] | None = None,
) -> Path:
    """``folder`` (the checkpoint tagged ``tag``) as a GGUF of ``outtype`` (f32, bf16, q8_0),
    made once by llama.cpp's converter (``vocab_as_llama``: see Checkpoint)."""
    out = dest / f"{tag}-{outtype}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".part")
        argv = [str(converter), str(folder), "--outtype", outtype, "--outfile", str(tmp)]
        command = [sys.executable, *argv]
        if vocab_as_llama is not None:  # the converter run with that class patched
            module, cls = vocab_as_llama
            here = converter.parent
            command = [sys.executable, "-c", (
                "import importlib, runpy, sys\n"
                f"sys.path[:0] = [{str(here)!r}, {str(here / 'gguf-py')!r}]\n"
                f"c = getattr(importlib.import_module({module!r}), {cls!r})\n"
                "c.set_vocab = lambda self: self._set_vocab_llama_hf()\n"
                f"sys.argv = {argv!r}\n"
                f"runpy.run_path({str(converter)!r}, run_name='__main__')\n"
            )]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{converter} --outtype {outtype} failed:\n{done.stderr[-4000:]}")
        tmp.rename(out)
    return out


# ---- workloads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: int
    shared_prefix: int  # tokens every prompt shares (0: none)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workloads(quick: bool, vocab: int) -> dict[str, Workload]:
    n, prefix, unique, new = (8, 512, 32, 8) if quick else (32, 2048, 64, 32)
    rng = random.Random(SEED)

    def toks(k: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab) for _ in range(k)]

    shared = toks(prefix)
    return {
        "shared_prefix": Workload(
            "shared_prefix", [shared + toks(unique) for _ in range(n)], new, prefix
        ),
        "no_sharing": Workload("no_sharing", [toks(prefix + unique) for _ in range(n)], new, 0),
    }


# ---- systems -------------------------------------------------------------------------------------
@dataclass
class System:
    """One way to run a workload: ``run`` returns each prompt's new token ids."""

    name: str
    engine: str  # radixkv, transformers, llama.cpp
    precision: str  # float32, bfloat16, q8_0
    run: Callable[[Workload], list[list[int]]]
    applies: Callable[[Workload], bool] = field(default=lambda w: True)
    note: str = ""


def radixkv_system(folder: Path, dtype: str, max_tokens: int, num_seqs: int) -> System:
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.pages import pages_for

    page = 16
    engine = Engine(
        str(folder),
        dtype=dtype,
        device="cpu",
        page_size=page,
        num_pages=num_seqs * (pages_for(max_tokens, page) + 1) + 8,
        max_running_requests=num_seqs,
    )

    def run(w: Workload) -> list[list[int]]:
        engine.reset_prefix_cache()  # every run starts cold, like the peers'
        params = SamplingParams(max_tokens=w.new_tokens, temperature=0.0, ignore_eos=True)
        outs = engine.generate(w.prompts, params, use_tqdm=False)
        engine.check_invariants()
        return [list(o.token_ids) for o in outs]

    return System(f"radixkv {dtype}", "radixkv", dtype, run, note="Engine, prefix cache on")


def _hf_model(folder: Path, dtype: torch.dtype) -> Any:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def _hf_generate(model: Any, ids: torch.Tensor, new: int, cache: Any = None) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,  # exactly `new` tokens, EOS or not (as the other systems)
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


def transformers_systems(folder: Path, dtype: torch.dtype) -> list[System]:
    from transformers import DynamicCache

    model = _hf_model(folder, dtype)
    name = str(dtype).removeprefix("torch.")

    @torch.inference_mode()
    def batched(w: Workload) -> list[list[int]]:
        return _hf_generate(model, torch.tensor(w.prompts), w.new_tokens).tolist()

    def prefix_cache(w: Workload) -> Any:
        cache = DynamicCache(config=model.config)
        prefix = torch.tensor([w.prompts[0][: w.shared_prefix]])
        model(prefix, cache=cache, logits_to_keep=1)  # no logits for the prefix
        return cache

    @torch.inference_mode()
    def per_request(w: Workload) -> list[list[int]]:
        cache = prefix_cache(w)
        return [
            _hf_generate(model, torch.tensor([p]), w.new_tokens, copy.deepcopy(cache))[0].tolist()
            for p in w.prompts
        ]

    @torch.inference_mode()
    def expanded(w: Workload) -> list[list[int]]:
        cache = prefix_cache(w)
        cache.batch_repeat_interleave(len(w.prompts))
        return _hf_generate(model, torch.tensor(w.prompts), w.new_tokens, cache).tolist()

    sharing = lambda w: w.shared_prefix > 0  # noqa: E731
    return [
        System(f"transformers {name} batched", "transformers", name, batched,
               note="one batched generate"),
        System(f"transformers {name} prefix cache, per request", "transformers", name,
               per_request, sharing, note="prefix prefilled once; deepcopy per request"),
        System(f"transformers {name} prefix cache, batched", "transformers", name, expanded,
               sharing, note="prefix prefilled once; cache repeated to the batch"),
    ]  # fmt: skip


def llama_cpp_system(gguf: Path, outtype: str, ctx: int) -> System:
    import llama_cpp

    kv_type = {"f32": 0, "bf16": 30}.get(outtype)  # GGML_TYPE_F32 / _BF16; q8_0: default f16
    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(
        str(gguf),
        n_ctx=ctx,
        n_batch=2048,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=kv_type,
        type_v=kv_type,
        seed=SEED,
        verbose=False,
    )

    def run(w: Workload) -> list[list[int]]:
        outs = []
        for p in w.prompts:
            got: list[int] = []
            for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                got.append(int(t))
                if len(got) == w.new_tokens:
                    break
            outs.append(got)
        return outs

    precision = {"f32": "float32", "bf16": "bfloat16"}.get(outtype, outtype)
    return System(f"llama.cpp {outtype}", "llama.cpp", precision, run,
                  note="llama-cpp-python, one sequence at a time, common prefix reused")  # fmt: skip


# ---- comparing outputs ---------------------------------------------------------------------------
def agreement(got: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """Requests whose greedy outputs are identical, and leading tokens that agree (mean)."""
    lead = []
    for a, b in zip(got, ref, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        lead.append(k)
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    return {"identical": f"{same}/{len(ref)}", "identical_frac": same / len(ref),
            "mean_agreeing_prefix": statistics.fmean(lead)}  # fmt: skip


# ---- the CPU's limit ----------------------------------------------------------------------------
def cpu_limit(repeats: int) -> dict[str, Any]:
    """Matmul peak (fp32, bf16) and radixkv-tiny's 4,096-token prefill against it."""
    from radixkv.kv.kv_pool import KVPool
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner, SeqInput
    from radixkv.onednn import linear

    total = 4096
    cfg = load_model("radixkv-tiny").config
    h, a, akv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (2 * h * a + 2 * h * akv + 3 * h * cfg.intermediate_size)
    # causal attention: q.k and p.v over total^2 / 2 pairs, per layer
    attention = 2 * cfg.num_layers * total * total * a
    flops = total * per_token + attention + 2 * h * cfg.vocab_size  # lm_head: last row only
    shapes = {"square 2048": (2048, 2048, 2048), "square 4096": (4096, 4096, 4096),
              "tiny MLP 4096x512x3072": (total, h, cfg.intermediate_size),
              "tiny MLP 4096x3072x512": (total, cfg.intermediate_size, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (total,), generator=gen).tolist()
    pages = list(range(total // 16))
    tasks: dict[str, Callable[[], object]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        for sname, (m, k, n) in shapes.items():
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen).to(dtype)
            tasks[f"matmul {sname} {dn}"] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
            if dtype == torch.float32:  # the oneDNN matmul the model runs (radixkv/onednn.py)
                tasks[f"matmul {sname} {dn} onednn"] = lambda x=x, w=w: linear(x, w, None)
        lm = load_model("radixkv-tiny", dtype=dtype)
        kv = KVPool(cfg.num_layers, len(pages) + 1, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        runner = ModelRunner(lm.model, kv)
        tasks[f"prefill {dn}"] = lambda r=runner: r.forward([SeqInput(ids, pages, 0)])
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"prefill_tokens": total, "prefill_gflop": flops / 1e9,
                           "repeats": repeats}  # fmt: skip
    # all cores (what the benchmarks run with), then one thread: a core's own efficiency, which
    # the other jobs of a shared machine disturb less (no thread waits for a preempted sibling)
    for label, n_threads in (("all_cores", threads), ("one_thread", 1)):
        if label == "one_thread" and threads == 1:
            break
        torch.set_num_threads(n_threads)
        try:
            best = _best_of(tasks, repeats)
        finally:
            torch.set_num_threads(threads)
        part: dict[str, Any] = {"threads": n_threads}
        for dtype in ("float32", "bfloat16"):
            # the peak is the fastest matmul PyTorch has for the dtype (fp32: MKL or oneDNN)
            rates = {f"{s}{lib}": 2 * m * k * n / best[f"matmul {s} {dtype}{lib}"] / 1e9
                     for s, (m, k, n) in shapes.items()
                     for lib in ("", " onednn") if f"matmul {s} {dtype}{lib}" in best}  # fmt: skip
            peak = max(rates.values())
            rate = flops / best[f"prefill {dtype}"] / 1e9
            part[dtype] = {"matmul_gflops": rates, "peak_gflops": peak,
                           "prefill_s": best[f"prefill {dtype}"], "prefill_gflops": rate,
                           "prefill_share_of_peak": rate / peak}  # fmt: skip
        out[label] = part
    return out


def _best_of(tasks: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest time of each task, sampled round robin (a slow spell hits every task alike)."""
    best = {k: math.inf for k in tasks}
    with torch.inference_mode():
        for fn in tasks.values():
            fn()  # warm-up
        for _ in range(repeats):
            for k, fn in tasks.items():
                t0 = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


# ---- shared with the other peer scripts ----------------------------------------------------------
def add_gguf_arguments(ap: argparse.ArgumentParser) -> None:
    """``--converter``, ``--fetch-converter`` and ``--cache``, as :func:`f32_checkpoint` reads
    them."""
    ap.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--fetch-converter", action="store_true", help="see bench_peers.py")
    ap.add_argument("--cache", type=Path, default=CACHE, help="checkpoint and GGUF files")


def f32_checkpoint(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[Path, Path]:
    """This benchmark's checkpoint folder and its f32 GGUF under ``args.cache``; the GGUF is
    converted only when missing (a usage error then without a converter)."""
    folder = checkpoint(args.cache)
    gguf = args.cache / f"{LLAMA.tag}-f32.gguf"
    if not gguf.is_file():
        converter = args.converter or (
            fetch_converter(args.cache) if args.fetch_converter else None
        )
        if converter is None:
            ap.error("the f32 GGUF is not made yet: pass --converter PATH or --fetch-converter")
        gguf = convert(folder, converter, "f32", args.cache)
    return folder, gguf


def rotated_rounds(
    systems: dict[str, Callable[[], Any]], rounds: int, label: str = ""
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run every system once a round, the order rotated one place a round (a slow spell hits
    each alike); returns (each one's times, each one's output in the last round)."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, Any] = {}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            last[name] = systems[name]()
            times[name].append(time.perf_counter() - t0)
            print(f"{label}round {r}: {name}: {times[name][-1]:.2f} s", flush=True)
    return times, last


# ---- main ----------------------------------------------------------------------------------------
def _timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(
    argv: Sequence[str] | None = None,
    *,
    ckpt: Checkpoint = LLAMA,
    results: Path = RESULTS,
    description: str | None = None,
    peak_repeats: int = 7,
) -> int:
    """The benchmark on ``ckpt`` (other scripts run it on their own checkpoint: a different
    ``results`` file and ``description``; ``peak_repeats`` is ``--peak-repeats``'s default)."""
    ap = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, 512 + 32 tokens, 8 new")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--workloads", default="shared_prefix,no_sharing")
    ap.add_argument("--systems", default="radixkv,transformers,llama.cpp")
    ap.add_argument("--precisions", default="float32,bfloat16,q8_0")
    ap.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--fetch-converter", action="store_true",
                    help="take the converter from the installed llama-cpp-python's sdist (pip)")  # fmt: skip
    ap.add_argument("--cache", type=Path, default=CACHE, help="checkpoint and GGUF files")
    ap.add_argument("--peak-repeats", type=int, default=peak_repeats,
                    help="cpu_limit: best of N (0: skip)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=results)
    args = ap.parse_args(argv)

    from radixkv.model.cpu_bf16 import cpu_bf16

    engines = set(args.systems.split(","))
    precisions = set(args.precisions.split(","))
    folder = checkpoint(args.cache, ckpt)
    workloads = {k: v for k, v in make_workloads(args.quick, ckpt.config["vocab_size"]).items()
                 if k in args.workloads.split(",")}  # fmt: skip
    longest = max(len(p) for w in workloads.values() for p in w.prompts)
    max_tokens = longest + max(w.new_tokens for w in workloads.values())
    num_seqs = max(len(w.prompts) for w in workloads.values())
    systems: list[System] = []
    torch_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for prec in ("float32", "bfloat16"):
        if prec not in precisions:
            continue
        if "radixkv" in engines:
            systems.append(radixkv_system(folder, prec, max_tokens, num_seqs))
        if "transformers" in engines:
            systems += transformers_systems(folder, torch_dtypes[prec])
    if "llama.cpp" in engines:
        converter = args.converter or (
            fetch_converter(args.cache) if args.fetch_converter else None
        )
        if converter is None:
            ap.error("llama.cpp needs --converter PATH or --fetch-converter")
        for outtype, prec in (("f32", "float32"), ("bf16", "bfloat16"), ("q8_0", "q8_0")):
            if prec in precisions:
                gguf = convert(folder, converter, outtype, args.cache, ckpt.tag,
                               ckpt.vocab_as_llama)  # fmt: skip
                systems.append(llama_cpp_system(gguf, outtype, max_tokens + 64))

    rng = random.Random(SEED)
    times: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    outputs: dict[str, dict[str, list[list[int]]]] = {w: {} for w in workloads}
    for rnd in range(args.runs):
        jobs = [(w, s) for w in workloads.values() for s in systems if s.applies(w)]
        rng.shuffle(jobs)
        for w, s in jobs:
            dt, out = _timed(lambda w=w, s=s: s.run(w))
            times[w.name].setdefault(s.name, []).append(dt)
            prev = outputs[w.name].setdefault(s.name, out)
            if prev != out:  # greedy and deterministic: every round must answer the same
                raise RuntimeError(f"{s.name} answered {w.name} differently in round {rnd + 1}")
            print(f"round {rnd + 1}/{args.runs} {w.name:14s} {s.name:45s} {dt:8.2f} s", flush=True)

    results: dict[str, Any] = {}
    by_name = {s.name: s for s in systems}
    for wname, per in times.items():
        rows = []
        refs = {p: outputs[wname].get(f"transformers {p} batched") for p in torch_dtypes}
        radix = {p: statistics.median(per[f"radixkv {p}"]) for p in torch_dtypes
                 if f"radixkv {p}" in per}  # fmt: skip
        for sname, ts in per.items():
            s = by_name[sname]
            med = statistics.median(ts)
            row: dict[str, Any] = {"system": sname, "precision": s.precision,
                                   "median_s": med, "runs_s": ts, "note": s.note}  # fmt: skip
            same = "bfloat16" if s.precision == "bfloat16" else "float32"
            if same in radix and s.engine != "radixkv":
                row["vs_radixkv_same_precision"] = med / radix[same]
            for ref_prec, ref in refs.items():
                if ref is not None and (ref_prec == same or ref_prec == "float32"):
                    row[f"agreement_vs_transformers_{ref_prec}"] = agreement(
                        outputs[wname][sname], ref
                    )
            rows.append(row)
        results[wname] = rows

    bf16 = cpu_bf16()
    data: dict[str, Any] = {
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, "
        f"load average at start {os.getloadavg()[0]:.1f}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "checkpoint": {
            "architecture": ckpt.model_class,
            **ckpt.config,
            "saved_dtype": "float32",
            "seed": SEED,
        },
        "cpu_native_bf16": {"native": bf16.native, "evidence": bf16.evidence},
        "torch_threads": torch.get_num_threads(),
        "versions": versions("torch", "transformers", "llama-cpp-python", "gguf", "radixkv"),
        "runs": args.runs,
        "quick": args.quick,
        "workloads": {w.name: _describe(w) for w in workloads.values()},
        **results,
    }
    if args.peak_repeats > 0:
        data["cpu_limit"] = cpu_limit(args.peak_repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    _print_table(data, workloads)
    print(f"wrote {args.out}")
    return 0


def cpu_name() -> str:
    """The CPU's model name (for the result files' machine line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _describe(w: Workload) -> dict[str, int]:
    return {
        "requests": len(w.prompts),
        "shared_prefix": w.shared_prefix,
        "prompt_tokens": w.prompt_tokens,
        "new_tokens": w.new_tokens,
    }


def versions(*packages: str) -> dict[str, str]:
    """Python's version and each installed package's (missing ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _print_table(data: dict[str, Any], workloads: dict[str, Workload]) -> None:
    for wname in workloads:
        print(f"\n{wname}")
        for row in sorted(data[wname], key=lambda r: (r["precision"], r["median_s"])):
            ratio = row.get("vs_radixkv_same_precision")
            agree = row.get("agreement_vs_transformers_float32", {}).get("identical", "-")
            print(f"  {row['system']:45s} {row['median_s']:8.2f} s"
                  f"  {'' if ratio is None else f'{ratio:5.2f}x radixkv'}"
                  f"  fp32 agreement {agree}")  # fmt: skip
    lim = data.get("cpu_limit")
    for label in ("all_cores", "one_thread"):
        part = (lim or {}).get(label)
        if not part:
            continue
        for dt in ("float32", "bfloat16"):
            d = part[dt]
            print(
                f"{label} ({part['threads']} threads) {dt}: peak {d['peak_gflops']:.0f} GFLOP/s, "
                f"tiny prefill {d['prefill_s'] * 1e3:.0f} ms = {d['prefill_gflops']:.0f} "
                f"GFLOP/s = {d['prefill_share_of_peak']:.0%} of peak"
            )


if __name__ == "__main__":
    raise SystemExit(main())
