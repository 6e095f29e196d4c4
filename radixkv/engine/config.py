"""Engine configuration: every engine knob in one frozen dataclass, validated on construction.

Torch-free to import (``radixkv serve --help`` reads it): the choice lists come from the
layers' torch-free ``names`` modules, the tables their registries build from.

Components take the config they need instead of copies of its fields. The ``radixkv serve`` and
``radixkv serve-ray`` command lines derive their engine flags from these fields
(:meth:`EngineConfig.add_cli_arguments`, :meth:`EngineConfig.from_cli_args`), so a knob added
here reaches both, with the same name, default, choices and help.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixkv.attention.names import ATTENTION_BACKENDS
from radixkv.cache.eviction import POLICIES
from radixkv.cache.tiers import WRITE_POLICIES, WRITE_THROUGH, WRITE_THROUGH_SELECTIVE
from radixkv.engine.names import CASCADE_MODES, OVERLAP_MODES, PREFILL_BUDGETS, SCHEDULE_POLICIES
from radixkv.kv.names import KV_CACHE_DTYPES
from radixkv.units import parse_bytes

if TYPE_CHECKING:
    import torch


def _cli(
    help: str,
    *,
    choices: Collection[str] | None = None,
    type: Callable[[str], Any] | None = None,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    nargs: str | None = None,
) -> dict[str, Any]:
    """Field metadata for the field's command-line flag: ``help``, ``choices``, the argparse
    ``type`` (default: the type of the field's default), for a bool that defaults to True the
    ``flag`` that turns it off (``--disable-...``), ``aliases``: other spellings of the same
    flag (vLLM's or SGLang's), accepted and listed in ``--help``, and argparse's ``nargs``."""
    return {
        "help": help,
        "choices": choices,
        "type": type,
        "flag": flag,
        "aliases": tuple(aliases),
        "nargs": nargs,
    }


# Keyword spellings of other engines accepted for a field (``Engine(enable_prefix_caching=False)``
# as in vLLM); each maps to exactly one field and means the same thing. ``canonical_options``
# applies them.
KEYWORD_ALIASES: dict[str, str] = {
    "enable_prefix_caching": "enable_prefix_cache",  # vLLM
    "context_length": "max_model_len",  # SGLang
}

# EngineConfig.host_layerwise_load ("auto": "off" for now, as measured; see the field)
LAYERWISE_LOAD_MODES = ("auto", "on", "off")

# EngineConfig.window_kv: how sliding-window layers keep K/V (radixkv/cache/window_slots.py)
WINDOW_KV_MODES = ("auto", "hybrid", "full")

# "auto" and the names parse_dtype knows (vLLM's --dtype choices)
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


def canonical_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with alias keywords (:data:`KEYWORD_ALIASES`) renamed to their field; raises
    TypeError when an alias and its field are both given (even with equal values: one spelling
    per call keeps a typo in one of them from hiding)."""
    out = dict(options)
    for alias, name in KEYWORD_ALIASES.items():
        if alias in out:
            if name in out:
                raise TypeError(f"{alias} is another name for {name}: pass one of them, not both")
            out[name] = out.pop(alias)
    return out


def _pos_int(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _one_of(name: str, v: object, allowed: Collection[str]) -> None:
    if not isinstance(v, str) or v not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {v!r}")


def _check_dtype(v: object) -> None:
    """None, one of :data:`DTYPES`, or a torch dtype the model layer supports."""
    if v is None or (isinstance(v, str) and v in DTYPES):
        return
    import torch

    from radixkv.model.config import parse_dtype

    if isinstance(v, torch.dtype | str):
        try:
            parse_dtype(v, "EngineConfig", "dtype")  # accepts "torch.float16" too
            return
        except ValueError:
            pass
    raise ValueError(f"dtype must be None, one of {DTYPES} or a torch dtype, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs (see each field's help). Raises ValueError naming the field on a bad value.

    KV pool size: ``num_pages`` wins over ``kv_cache_memory`` (bytes); with neither, the pool
    gets 1 GiB on a CPU or half the free memory on a GPU. A step computes at most
    ``min(max_prefill_tokens, chunked_prefill_size)`` prefill tokens in all (``None``, 0 or -1
    disables chunking); ``prefill_budget`` says whether that counts new tokens only ("tokens") or
    new tokens plus their attention to past ones ("attention", see engine/prefill_cost.py).

    ``Engine(...)`` also takes the spellings in :data:`KEYWORD_ALIASES` (``enable_prefix_caching``,
    ``context_length``), and the flags have vLLM's / SGLang's aliases (``--disable-radix-cache``,
    ``--context-length``).
    """

    # 16 tokens: small enough that little of a prompt is left in an uncacheable partial page,
    # large enough that page tables and the trie stay short
    page_size: int = field(
        default=16, metadata=_cli("tokens per KV page (only whole pages are cached)")
    )
    num_pages: int | None = field(
        default=None, metadata=_cli("KV pool size in pages (wins over --kv-cache-memory)", type=int)
    )
    # byte counts: an int, or a string such as "4GB" / "16GiB" (read by units.parse_bytes and
    # stored as the int)
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata=_cli(
            "KV pool size in bytes, e.g. 2GiB (default: 1 GiB on a CPU, half the free GPU memory)",
            type=parse_bytes,
        ),
    )
    # off by default: a host tier pays only when the working set outgrows the device pool
    # (bench/bench_tiers.py, docs/cache_design.md "Tiers")
    host_cache_memory: int | str | None = field(
        default=None,
        metadata=_cli(
            "host-memory KV tier size in bytes (e.g. 4GB, 16GiB); evicted prefixes stay in host "
            "memory and are copied back instead of recomputed (default: no host tier)",
            type=parse_bytes,
        ),
    )
    write_policy: str = field(
        default=WRITE_THROUGH,
        metadata=_cli(
            "when cached pages are copied to the host tier: on insert, once hit "
            "--write-through-threshold times, or when evicted from the device",
            choices=WRITE_POLICIES,
        ),
    )
    write_through_threshold: int = field(
        default=1,
        metadata=_cli("hits before write_through_selective backs a prefix up to the host tier"),
    )
    # a host hit copied back layer by layer, each layer of the forward waiting only for its own
    # pages (radixkv/kv/layer_loads.py). "auto" is off for now on every device, as measured
    # (bench/bench_tiers.py --layerwise, docs/tuning.md): on a CPU pool the copy is a memcpy
    # that competes with the forward for the cores (no gain, at worst slower, where none is
    # free); on CUDA the per-layer path (two transfers per page and layer, issued from Python)
    # awaits bench/gpu_check_tiers.py on a GPU. With DMA-like transfers (simulated) it pays.
    host_layerwise_load: str = field(
        default="auto",
        metadata=_cli(
            "copy host-tier hits back layer by layer while the forward runs, each layer "
            "waiting only for its own pages (on), or all at once before it (off); auto: off "
            "for now on every device (docs/tuning.md)",
            choices=LAYERWISE_LOAD_MODES,
        ),
    )
    # off by default: a storage tier is for prefixes that must outlive the process or be shared
    # by a fleet (docs/cache_design.md "Storage tier", docs/tuning.md "Storage tier")
    kv_storage: str | None = field(
        default=None,
        metadata=_cli(
            "KV storage tier URL: file:///path (a directory; ?quota=50GB) or "
            "redis://host:port/db (Redis or Valkey; ?ttl=SECONDS). Prefixes survive restarts "
            "and are shared by every engine using it; needs a host tier (default: one as large "
            "as the KV pool, at most 4 GiB)",
            type=str,
        ),
    )
    kv_storage_write_policy: str = field(
        default=WRITE_THROUGH,
        metadata=_cli(
            "when host-tier pages are written to storage: once in the host tier, once hit "
            "--kv-storage-write-threshold times, or when evicted from the host tier (and at "
            "close)",
            choices=WRITE_POLICIES,
        ),
    )
    # None: --write-through-threshold, as before the storage tier had a threshold of its own
    kv_storage_write_threshold: int | None = field(
        default=None,
        metadata=_cli(
            "hits before write_through_selective writes a host-tier prefix to storage "
            "(default: --write-through-threshold; with --write-policy write_through_selective "
            "too, at most that)",
            type=int,
        ),
    )
    # 16 tokens (a page at the default page size): a missed lookup costs 63 us (directory) or
    # 133 us (Valkey on loopback), less than recomputing a token of radixkv-tiny on a CPU, so
    # every whole page is worth a lookup there; raise it to (miss round trip / prefill cost per
    # token) when prefill is cheap or the store far (bench/bench_tiers.py --storage, tuning.md)
    kv_storage_prefetch_threshold: int = field(
        default=16,
        metadata=_cli("fewest tokens a storage lookup must be able to find to be started"),
    )
    # 1 s: a healthy store answers a long prefix in milliseconds; a request never waits longer
    kv_storage_timeout: float = field(
        default=1.0,
        metadata=_cli(
            "seconds a request waits for its storage prefetch (and a Redis call may take) "
            "before it proceeds as a miss"
        ),
    )
    kv_storage_write_queue: int = field(
        default=4096,
        metadata=_cli("pages waiting to be written to storage before writes are dropped"),
    )
    # None: $RADIXKV_STORAGE_SECRET, else ~/.config/radixkv/storage_secret (created, mode 0600);
    # every engine sharing a store needs the same secret (docs/security.md, storage tier)
    kv_storage_secret_file: str | None = field(
        default=None,
        metadata=_cli(
            "file holding the hex secret that MACs stored KV pages (default: "
            "$RADIXKV_STORAGE_SECRET, else ~/.config/radixkv/storage_secret, created if absent)",
            type=str,
        ),
    )
    max_running_requests: int = field(default=256, metadata=_cli("most sequences running at once"))
    # 8192 / 2048: a step computes at most 2048 prefill tokens, so running streams stall at most
    # one chunk's time and a burst of short prompts runs as several short steps (scheduler.py)
    max_prefill_tokens: int = field(default=8192, metadata=_cli("most prefill tokens in one step"))
    chunked_prefill_size: int | None = field(
        default=2048,
        metadata=_cli(
            "longest prefill chunk of one sequence per step; 0 or -1 disables chunking", type=int
        ),
    )
    prefill_budget: str = field(
        default="tokens",
        metadata=_cli(
            "what the step budget counts: new tokens, or new tokens plus their attention to past "
            "ones (splits steps whose new tokens attend to long cached prefixes)",
            choices=PREFILL_BUDGETS,
        ),
    )
    # "lpm": admit the longest cached prefix first, so a shared prefix is hit while it is cached
    schedule_policy: str = field(
        default="lpm",
        metadata=_cli(
            "admission order of waiting requests (engine/schedule_policy.py)",
            choices=SCHEDULE_POLICIES,
        ),
    )
    # fair admission (schedule_policy.py): waiting requests of different tenants
    # (SamplingParams.tenant, which the server sets from the API key) are interleaved, the
    # least-served tenant first; requests without a tenant are admitted as before
    fair_admission: bool = field(
        default=True,
        metadata=_cli(
            "admit waiting requests in the schedule policy's order over the whole queue instead "
            "of interleaving tenants (API keys), the one running fewest first",
            flag="--disable-fair-admission",
        ),
    )
    tenant_max_running: int | None = field(
        default=None,
        metadata=_cli(
            "most sequences of one tenant (API key) running at once; the rest wait their turn "
            "(default: no cap but --max-running-requests)",
            type=int,
        ),
    )
    enable_prefix_cache: bool = field(
        default=True,
        metadata=_cli(
            "turn the prefix cache off (every prompt is computed)",
            flag="--disable-prefix-cache",
            aliases=("--disable-radix-cache",),  # SGLang
        ),
    )
    eviction_policy: str = field(
        default="lru", metadata=_cli("which cached pages go first", choices=tuple(POLICIES))
    )
    # Speculative decoding by prompt lookup (engine/speculative.py): up to this many draft
    # tokens a step, taken from an earlier occurrence of the sequence's last tokens and
    # verified in the same forward (greedy: the same tokens; sampled: the same distribution);
    # 0 turns it off (the default: it pays where
    # text repeats, code edits and quotes, and costs a wider forward where it does not)
    num_speculative_tokens: int = field(
        default=0,
        metadata=_cli("prompt-lookup draft tokens a step (speculative decoding; 0: off)", type=int),
    )
    # the longest and shortest run of last tokens looked up for drafts (vLLM's names)
    prompt_lookup_max: int = field(
        default=4, metadata=_cli("longest n-gram looked up for drafts", type=int)
    )
    prompt_lookup_min: int = field(
        default=2, metadata=_cli("shortest n-gram looked up for drafts", type=int)
    )
    # Guided decoding: where the output's language allows exactly one next token, append it at
    # once (no decode step of its own; the run is computed as one chunk with the next step),
    # as SGLang's jump-forward does. Not for requests that ask for logprobs (the forced tokens
    # would have none); with greedy decoding the output is the same either way.
    guided_jump_forward: bool = field(
        default=True,
        metadata=_cli(
            "guided decoding: sample every token, even those the language forces",
            flag="--disable-jump-forward",
            aliases=("--disable-regex-jump-forward",),  # SGLang
        ),
    )
    # None: the model's max_position_embeddings
    max_model_len: int | None = field(
        default=None,
        metadata=_cli(
            "longest prompt + output in tokens (default and most: the model's context length)",
            type=int,
            aliases=("--context-length",),  # SGLang
        ),
    )
    # "auto": flashinfer on a CUDA pool in fp16/bf16 when it is installed, else torch
    attention_backend: str = field(
        default="auto", metadata=_cli("attention kernels", choices=ATTENTION_BACKENDS)
    )
    # "auto": read shared prefixes once per group only when the step saves enough reads
    cascade: str = field(
        default="auto",
        metadata=_cli(
            "shared-prefix (cascade) decode attention: when it pays, always, or never",
            choices=CASCADE_MODES,
        ),
    )
    # "auto": on where the device runs asynchronously (CUDA), off on a CPU, whose forward
    # already uses every core (engine/overlap.py; measured in bench/bench_overlap.py)
    overlap: str = field(
        default="auto",
        metadata=_cli(
            "schedule and prepare the next step while the device runs this one (one step's "
            "lag; auto: on CUDA, off on a CPU)",
            choices=OVERLAP_MODES,
        ),
    )
    device: str | torch.device | None = field(
        default=None, metadata=_cli("torch device (default: cuda if available, else cpu)", type=str)
    )
    # None keeps the checkpoint's dtype everywhere (bit-exact, the default); "auto" picks the fast
    # one: bfloat16 on a CPU with bf16 units, float32 on other CPUs, half precision on a GPU
    # (radixkv/model/dtype.py decides and logs it)
    dtype: str | torch.dtype | None = field(
        default=None,
        metadata=_cli(
            "weight and KV dtype (default: the checkpoint's; auto: bfloat16 on a CPU with bf16 "
            "units, float32 on other CPUs, half precision on a GPU)",
            choices=DTYPES,
            type=str,
        ),
    )
    # "auto" stores K/V in the model's dtype (exact: the cache changes no output). fp8 halves a
    # bf16 page, so the same memory caches twice the prefixes, at a small cost in accuracy
    # (docs/tuning.md "KV cache dtype"); attention still computes in the model's dtype
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_cli(
            "dtype the KV pages store (auto: the model's; fp8 = fp8_e4m3: half the bytes of "
            "bf16 per token, so twice the cached prefixes in the same memory)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    # Hybrid window KV (radixkv/cache/window_slots.py): a model mixing sliding-window and
    # full-attention layers keeps its windowed layers' K/V only for the tokens a window can
    # still read, plus what fits as cache, so the same memory holds more pages. "auto" is
    # hybrid for such a model unless a host or storage tier is set (they copy whole pages)
    window_kv: str = field(
        default="auto",
        metadata=_cli(
            "sliding-window layers' K/V: hybrid keeps it only for tokens a window can still "
            "read (more pages in the same memory), full for every cached token (auto: hybrid "
            "for models with sliding-window layers, without a host or storage tier)",
            choices=WINDOW_KV_MODES,
        ),
    )
    # Window slots per page under hybrid window KV. A slot costs the windowed layers' share of
    # a page; fewer slots leave more memory to pages, but cache less windowed K/V (a cached
    # prefix serves only as far as its last window still has slots). Half: Gemma 3's pages
    # (5 windowed layers of 6) cost 0.58 of a full page, so 1.7x the pages fit
    window_kv_ratio: float = field(
        default=0.5,
        metadata=_cli(
            "window slots per KV page under hybrid window KV, in (0, 1] (each holds a "
            "page's K/V in the sliding-window layers)",
            type=float,
        ),
    )
    # Model source: a Hugging Face repo id is fetched through huggingface_hub (model/hub.py)
    revision: str | None = field(
        default=None,
        metadata=_cli("branch, tag or commit of a Hugging Face repo id (default: main)", type=str),
    )
    gguf_file: str | None = field(
        default=None,
        metadata=_cli(
            "the GGUF file to load from the model folder or Hugging Face repo id (a *.gguf "
            "path or a packaged model's name needs none)",
            type=str,
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_cli("folder or Hugging Face repo id to take the tokenizer from", type=str),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_cli(
            "chat template file (or the template itself) replacing the model's", type=str
        ),
    )
    seed: int = field(default=0, metadata=_cli("seed of the per-request sampling seeds"))
    # LoRA adapters loaded at start (more with Engine.load_lora): PEFT adapter folders by name,
    # as {name: path} or "name=path" strings; normalised to (name, path) pairs
    lora_modules: Any = field(
        default=None,
        metadata=_cli(
            "LoRA adapters to load, as name=path (a PEFT adapter folder or Hugging Face repo "
            "id); requests pick one by name (the server's 'model' field)",
            type=str,
            nargs="+",
        ),
    )

    def __post_init__(self) -> None:
        _pos_int("page_size", self.page_size)
        if self.num_pages is not None:
            _pos_int("num_pages", self.num_pages)
        for name in ("kv_cache_memory", "host_cache_memory"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = parse_bytes(value)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
                object.__setattr__(self, name, value)  # frozen: normalised once, here
            if value is not None:
                _pos_int(name, value)
        _one_of("write_policy", self.write_policy, WRITE_POLICIES)
        _pos_int("write_through_threshold", self.write_through_threshold)
        _one_of("host_layerwise_load", self.host_layerwise_load, LAYERWISE_LOAD_MODES)
        if self.kv_storage is not None and (
            not isinstance(self.kv_storage, str) or not self.kv_storage.strip()
        ):
            raise ValueError(f"kv_storage must be a storage URL, got {self.kv_storage!r}")
        _one_of("kv_storage_write_policy", self.kv_storage_write_policy, WRITE_POLICIES)
        st = self.kv_storage_write_threshold
        if st is not None:
            _pos_int("kv_storage_write_threshold", st)
            both = self.write_policy == self.kv_storage_write_policy == WRITE_THROUGH_SELECTIVE
            if both and st > self.write_through_threshold:
                # the cache reports a host page's hits at one count, the host tier's
                raise ValueError(
                    f"kv_storage_write_threshold {st} exceeds write_through_threshold "
                    f"{self.write_through_threshold} while write_policy and "
                    "kv_storage_write_policy are both write_through_selective: a page reaches "
                    "the host tier at write_through_threshold hits and its later hits are not "
                    "counted for storage; raise write_through_threshold or lower this"
                )
        _pos_int("kv_storage_prefetch_threshold", self.kv_storage_prefetch_threshold)
        t = self.kv_storage_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 600:
            raise ValueError(f"kv_storage_timeout must be seconds in (0, 600], got {t!r}")
        _pos_int("kv_storage_write_queue", self.kv_storage_write_queue)
        f = self.kv_storage_secret_file
        if f is not None and (not isinstance(f, str) or not f.strip()):
            raise ValueError(f"kv_storage_secret_file must be a file path, got {f!r}")
        _pos_int("max_running_requests", self.max_running_requests)
        _pos_int("max_prefill_tokens", self.max_prefill_tokens)
        if self.chunked_prefill_size not in (None, 0, -1):  # -1: SGLang's "off"
            _pos_int("chunked_prefill_size", self.chunked_prefill_size)
        _one_of("prefill_budget", self.prefill_budget, PREFILL_BUDGETS)
        _one_of("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        if not isinstance(self.fair_admission, bool):
            raise ValueError(f"fair_admission must be a bool, got {self.fair_admission!r}")
        if self.tenant_max_running is not None:
            _pos_int("tenant_max_running", self.tenant_max_running)
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(
                f"enable_prefix_cache must be a bool, got {self.enable_prefix_cache!r}"
            )
        _one_of("eviction_policy", self.eviction_policy, tuple(POLICIES))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 64:
            raise ValueError(f"num_speculative_tokens must be an int in [0, 64], got {k!r}")
        _pos_int("prompt_lookup_min", self.prompt_lookup_min)
        _pos_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if not isinstance(self.guided_jump_forward, bool):
            raise ValueError(
                f"guided_jump_forward must be a bool, got {self.guided_jump_forward!r}"
            )
        if self.max_model_len is not None:
            _pos_int("max_model_len", self.max_model_len)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("cascade", self.cascade, CASCADE_MODES)
        _one_of("overlap", self.overlap, OVERLAP_MODES)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        _check_dtype(self.dtype)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("window_kv", self.window_kv, WINDOW_KV_MODES)
        r = self.window_kv_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r <= 1:
            raise ValueError(f"window_kv_ratio must be a number in (0, 1], got {r!r}")
        if self.lora_modules is not None:
            from radixkv.engine.lora import parse_lora_modules  # imports torch (the model layer)

            pairs = parse_lora_modules(self.lora_modules)
            object.__setattr__(self, "lora_modules", pairs or None)
        for name in ("revision", "gguf_file", "tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    @property
    def chunk_size(self) -> int | None:
        """``chunked_prefill_size`` with 0 and -1 read as None (no chunking)."""
        size = self.chunked_prefill_size
        return size if size is not None and size > 0 else None

    @property
    def step_prefill_budget(self) -> int:
        """Prefill tokens (budget units) of one whole step: ``min(max_prefill_tokens,
        chunked_prefill_size)``."""
        return min(self.max_prefill_tokens, self.chunk_size or self.max_prefill_tokens)

    def options(self) -> dict[str, Any]:
        """The fields that are set (not None), as keyword arguments: ``Engine(model,
        **config.options())`` builds the same engine (used to ship a config to Ray replicas)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    # ------------------------------------------------------------------ command line
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Declare one flag per field on ``parser`` (``page_size`` -> ``--page-size``; a bool
        that defaults to True gets its ``--disable-...`` flag); returns ``parser``."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["flag"] is not None:
                group.add_argument(
                    meta["flag"], *meta["aliases"], action="store_true", help=meta["help"]
                )
                continue
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                *meta["aliases"],
                type=meta["type"] or type(f.default),
                default=f.default,
                choices=meta["choices"],
                help=meta["help"],
                **({"nargs": meta["nargs"]} if meta["nargs"] else {}),
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of flags declared by :meth:`add_cli_arguments` (raises ValueError)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"]
            if flag is not None:
                values[f.name] = not getattr(args, flag.lstrip("-").replace("-", "_"))
            else:
                values[f.name] = getattr(args, f.name)
        return cls(**values)
