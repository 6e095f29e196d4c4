"""A ``POST /generate`` request (native_protocol.py) checked and resolved into a :class:`Plan`:
one :class:`Item` per prompt with its token ids, :class:`SamplingParams`, logprob plan, LoRA
adapter and prefix-cache namespace. Nothing is submitted here; a bad field is a 400 naming it
(``text``, ``sampling_params[1].n``, ...)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixkv.engine.params import GuidedDecodingParams, SamplingParams, is_int
from radixkv.server import protocol as P
from radixkv.server.auth import Principal
from radixkv.server.errors import bad_request
from radixkv.server.native_protocol import (
    GREEDY_BELOW,
    GUIDED_FIELDS,
    MAX_STOP_STRINGS,
    REFUSED,
    SAMPLING_FIELDS,
    TOP_K_ALL,
    GenerateRequest,
    NativeSamplingParams,
    is_set,
)
from radixkv.server.state import ServerState


@dataclass(frozen=True)
class LogprobPlan:
    """What a prompt returns of logprobs (``return_logprob``): ``start`` is SGLang's
    ``logprob_start_len`` resolved (the prompt's length: output tokens only), ``top`` is
    ``top_logprobs_num``, ``text``: each entry carries its token's text, ``token_ids``:
    ``token_ids_logprob``, the ids whose logprobs every position reports."""

    start: int
    top: int
    text: bool
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Item:
    """One prompt of a /generate request and how it runs."""

    ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # as asked: 0 runs the prompt and shows no output (SGLang's prefill)
    sample_ids: list[str]  # meta_info.id per returned entry (beam search: one)
    logprobs: LogprobPlan | None
    lora: str | None
    namespace: Any
    guided_param: str | None  # the field a guided-decoding error names

    @property
    def beam(self) -> bool:
        return self.params.beam_width > 0

    @property
    def hidden(self) -> bool:
        return self.max_new_tokens == 0


@dataclass(frozen=True)
class Plan:
    items: list[Item]
    batch: bool  # the answer is a list (a list of prompts, or n > 1)
    stream: bool
    prompt_token_ids: bool  # each entry carries its prompt's ids (return_prompt_token_ids)
    source: str  # "text" or "input_ids": the field the prompts came from


def _field(name: str, i: int | None) -> str:
    return name if i is None else f"{name}[{i}]"


def _sampling_param(field: str, i: int | None) -> str:
    return f"{_field('sampling_params', i)}.{field}"


def _per_prompt(value: Any, name: str, count: int, batch: bool) -> list[Any]:
    """A field that is one value for every prompt or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if not batch and len(value) == 1:
        return value
    if not batch:
        raise bad_request(f"{name} must be a single value for a single prompt", name)
    if len(value) != count:
        raise bad_request(
            f"{name} has {len(value)} entries for {count} prompts (give one value or one per "
            "prompt)",
            name,
        )
    return value


def parse_sampling_params(raw: dict[str, Any], i: int | None) -> NativeSamplingParams:
    """One ``sampling_params`` object, or 400 naming the field (``sampling_params.x``, in a
    list ``sampling_params[i].x``); an unknown key is refused, as SGLang refuses it."""
    for key in raw:
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise bad_request(
                f"unknown field `{key}` in sampling_params, expected one of {listed}",
                _sampling_param(key, i),
            )
    try:
        sp = msgspec.convert(raw, NativeSamplingParams)
    except msgspec.ValidationError as e:
        msg = str(e)
        path = msg.rpartition("- at `$")[2].rstrip("`")
        field = path.lstrip(".").split("[", 1)[0].split(".", 1)[0] or None
        param = _sampling_param(field, i) if field else _field("sampling_params", i)
        raise bad_request(f"{param}: {msg}", param) from None
    for name, why in (
        ("stop_regex", "stop regexes are not supported (use stop strings)"),
        ("structural_tag", "structural tags are not supported (use json_schema or ebnf)"),
        ("watermark", "watermarking is not supported"),
    ):
        if is_set(getattr(sp, name)):
            param = _sampling_param(name, i)
            raise bad_request(f"{param} is not supported by this server: {why}", param)
    return sp


def _guided(sp: NativeSamplingParams, i: int | None) -> tuple[GuidedDecodingParams | None, str]:
    """The constraint of ``sp`` (at most one of json_schema, regex, ebnf and choice) and the
    parameter a compile error names."""
    given = [
        f for f in GUIDED_FIELDS if getattr(sp, f) not in (None, "", [])
    ]  # SGLang: empty means unset
    if not given:
        return None, ""
    param = _sampling_param(given[0], i)
    if len(given) > 1:
        raise bad_request(
            f"only one of json_schema, regex, ebnf and choice can be set, got {', '.join(given)}",
            param,
        )
    try:
        if sp.json_schema is not None and sp.json_schema != "":
            schema = sp.json_schema
            return GuidedDecodingParams(json="{}" if schema == "$$ANY$$" else schema), param
        if sp.regex:
            return GuidedDecodingParams(regex=sp.regex), param
        if sp.ebnf:
            return GuidedDecodingParams(grammar=sp.ebnf), param
        return GuidedDecodingParams(choice=tuple(sp.choice or ())), param
    except (ValueError, TypeError) as e:
        raise bad_request(f"{param}: {e}", param) from None


# radixkv SamplingParams field (the start of its error messages) -> the SGLang field
_ENGINE_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
    "beam": "beam_width",
}
_TOP_LEVEL_NAMES = {
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "prompt_logprobs_start": "logprob_start_len",
    "priority": "priority",
}


class Planner:
    """Validates a /generate request into a :class:`Plan` (400 naming the field otherwise)."""

    def __init__(self, st: ServerState, principal: Principal) -> None:
        self.st = st
        self.principal = principal

    def prompts(self, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
        """The prompts' token ids, whether they are a batch, and the field they came from."""
        if (req.text is None) == (req.input_ids is None):
            if req.text is None:
                raise bad_request("Either text or input_ids should be provided.", "text")
            raise bad_request("text and input_ids: give exactly one of them", "input_ids")
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            if not texts:
                raise bad_request("text must not be an empty list", "text")
            batch = not isinstance(req.text, str)
            out = []
            for i, t in enumerate(texts):
                ids = list(self.st.tokenizer.encode(t))
                if not ids:
                    raise bad_request(
                        "text encodes to no tokens", _field("text", i if batch else None)
                    )
                out.append(ids)
            return out, batch, "text"
        raw = req.input_ids
        assert raw is not None
        if not raw:
            raise bad_request("input_ids cannot be empty.", "input_ids")
        flat = [x for x in raw if isinstance(x, int)]
        if len(flat) == len(raw):
            return [self.st.check_ids(flat, "input_ids")], False, "input_ids"
        if not all(isinstance(x, list) for x in raw):
            raise bad_request(
                "input_ids must be a list of token ids or a list of such lists (not a mixture)",
                "input_ids",
            )
        out = []
        for i, ids in enumerate(raw):
            assert isinstance(ids, list)
            if not ids:
                raise bad_request("input_ids cannot be empty.", f"input_ids[{i}]")
            out.append(self.st.check_ids(list(ids), f"input_ids[{i}]"))
        return out, True, "input_ids"

    def plan(self, req: GenerateRequest) -> Plan:
        for name, why in REFUSED.items():
            if is_set(getattr(req, name)):
                raise bad_request(f"{name} is not supported by this server: {why}", name)
        prompts, batch, source = self.prompts(req)
        count = len(prompts)
        raw_sp = req.sampling_params
        if isinstance(raw_sp, list):
            if not batch and len(raw_sp) != 1:
                raise bad_request(
                    "sampling_params must be one object for a single prompt", "sampling_params"
                )
            if batch and len(raw_sp) != count:
                raise bad_request(
                    f"sampling_params has {len(raw_sp)} entries for {count} prompts",
                    "sampling_params",
                )
            sps = [parse_sampling_params(d, i) for i, d in enumerate(raw_sp)]
        else:
            sps = [parse_sampling_params(raw_sp or {}, None)] * count
        ns = {sp.n or 1 for sp in sps}
        if len(ns) > 1:
            raise bad_request(
                "The parallel_sample_num should be the same for all samples in sample params.",
                "sampling_params",
            )
        n = ns.pop()
        beams = [(sp.beam_width or 1) > 1 for sp in sps]
        if len(set(beams)) > 1:
            raise bad_request(
                "beam_width must be > 1 for every prompt of a batch or for none",
                "sampling_params",
            )
        beam = beams[0]
        answer_is_list = batch or (n > 1 and not beam)
        rids = self.sample_ids(req.rid, count, batch, n, beam)
        flags = _per_prompt(req.return_logprob, "return_logprob", count, batch)
        starts = _per_prompt(req.logprob_start_len, "logprob_start_len", count, batch)
        tops = _per_prompt(req.top_logprobs_num, "top_logprobs_num", count, batch)
        asked = self.token_ids_logprob(req.token_ids_logprob, count, batch)
        loras = _per_prompt(req.lora_path, "lora_path", count, batch)
        salts = _per_prompt(req.cache_salt, "cache_salt", count, batch)
        keys = _per_prompt(req.extra_key, "extra_key", count, batch)
        priority = self.priority(req.priority)
        items = []
        for i, ids in enumerate(prompts):
            at = i if batch else None
            logprobs = self.logprobs(ids, flags[i], starts[i], tops[i], req, at, asked[i])
            sp = sps[i]
            sp_at = i if isinstance(raw_sp, list) else None  # the list entry errors name
            params, max_new, guided_param = self.sampling(
                sp, ids, logprobs, priority, _field(source, at), sp_at
            )
            lora_at = at if isinstance(req.lora_path, list) else None
            items.append(
                Item(
                    ids=ids,
                    params=params,
                    max_new_tokens=max_new,
                    sample_ids=rids[i],
                    logprobs=logprobs,
                    lora=self.lora(loras[i], _field("lora_path", lora_at)),
                    namespace=self.namespace(salts[i], keys[i], at),
                    guided_param=guided_param,
                )
            )
        return Plan(items, answer_is_list, req.stream, req.return_prompt_token_ids, source)

    @staticmethod
    def sample_ids(
        rid: str | list[str] | None, count: int, batch: bool, n: int, beam: bool
    ) -> list[list[str]]:
        """meta_info.id of each returned entry, per prompt, as SGLang names them: the ``rid``
        (a batch's given list, or ``rid_i`` from one string), else a fresh id; each of ``n`` > 1
        samples gets a fresh id (SGLang runs them as requests of their own)."""
        if isinstance(rid, list):
            if not batch and len(rid) == 1:
                rid = rid[0]
            elif not batch:
                raise bad_request("rid must be a string for a single prompt", "rid")
            elif len(rid) != count:
                raise bad_request(
                    "The specified rids length mismatch with the batch_size for batch processing.",
                    "rid",
                )
            elif len(set(rid)) != len(rid):
                dup = sorted({r for r in rid if rid.count(r) > 1})
                raise bad_request(
                    f"Duplicate request IDs detected within the request: {dup}", "rid"
                )
        if n > 1 and not beam:
            return [[uuid.uuid4().hex for _ in range(n)] for _ in range(count)]
        if isinstance(rid, list):
            return [[r] for r in rid]
        if rid is None:
            return [[uuid.uuid4().hex] for _ in range(count)]
        return [[f"{rid}_{i}"] for i in range(count)] if batch else [[rid]]

    def priority(self, priority: int | None) -> int:
        """The engine's priority (lower first) of SGLang's (higher first, its default). The
        engine's intake refuses one under another schedule policy (native.py words it)."""
        if not priority:
            return 0
        if abs(priority) > 2**31 - 1:
            raise bad_request("priority must be in [-(2**31 - 1), 2**31 - 1]", "priority")
        return -priority

    def logprobs(
        self,
        ids: list[int],
        flag: bool | None,
        start: int | None,
        top: int | None,
        req: GenerateRequest,
        at: int | None,
        token_ids: tuple[int, ...] = (),
    ) -> LogprobPlan | None:
        if not flag:
            return None  # SGLang ignores logprob_start_len, top_logprobs_num, ... then
        top = top or 0
        if not 0 <= top <= P.MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs_num must be in [0, {P.MAX_LOGPROBS}], got {top}", "top_logprobs_num"
            )
        if start is None or start == -1:
            start = len(ids)  # output tokens only
        elif start < -1:
            raise bad_request(
                f"logprob_start_len must be -1 (output only) or >= 0, got {start}",
                "logprob_start_len",
            )
        elif start > len(ids):
            raise bad_request(
                f"logprob_start_len={start} is higher than the number of input tokens "
                f"({len(ids)}{'' if at is None else f' in prompt {at}'}). Please use a smaller "
                "logprob_start_len.",
                "logprob_start_len",
            )
        return LogprobPlan(start, top, req.return_text_in_logprobs, token_ids)

    def token_ids_logprob(self, value: Any, count: int, batch: bool) -> list[tuple[int, ...]]:
        """``token_ids_logprob`` per prompt: one list of ids for every prompt, or (a batch) one
        list per prompt; ids in the vocabulary, repeats dropped."""
        name = "token_ids_logprob"
        if value is None:
            return [()] * count
        shape = f"{name} must be a list of token ids, or a list of them per prompt"
        if not isinstance(value, list):
            raise bad_request(shape, name)
        if all(is_int(t) for t in value):
            lists = [value] * count
        elif all(x is None or isinstance(x, list) for x in value):
            lists = [x or [] for x in _per_prompt(value, name, count, batch)]
            if not all(is_int(t) for x in lists for t in x):
                raise bad_request(shape, name)
        else:
            raise bad_request(shape, name)
        return [tuple(dict.fromkeys(self.st.check_ids(list(x), name))) for x in lists]

    def sampling(
        self,
        sp: NativeSamplingParams,
        ids: list[int],
        logprobs: LogprobPlan | None,
        priority: int,
        prompt_param: str,
        i: int | None,
    ) -> tuple[SamplingParams, int, str | None]:
        """The engine's parameters for one prompt, the max_new_tokens asked for, and the
        field a guided-decoding error names."""
        st = self.st
        max_new = sp.max_new_tokens
        if max_new is None:  # null: up to the context length
            max_new = st.max_context - len(ids)
            if max_new < 1:
                st.check_length(ids, 1, prompt_param)
        min_new = sp.min_new_tokens or 0
        if min_new > max_new:
            raise bad_request(
                f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.",
                _sampling_param("min_new_tokens", i),
            )
        engine_max = max(1, max_new)  # 0: the prompt runs (cached, scored) and one token
        st.check_length(ids, engine_max, prompt_param)
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}",
                _sampling_param("stop", i),
            )
        if any(s == "" for s in stops):
            raise bad_request("stop strings must be non-empty", _sampling_param("stop", i))
        stop_ids = list(sp.stop_token_ids or ())
        st.check_ids(stop_ids, _sampling_param("stop_token_ids", i))
        bias: dict[int, float] = {}
        for key, value in (sp.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise bad_request(
                    f"logit_bias keys must be token ids (digits), got {key[:40]!r}",
                    _sampling_param("logit_bias", i),
                )
            bias[int(key)] = value
        st.check_ids(list(bias), _sampling_param("logit_bias", i))
        top_k = 0 if sp.top_k is None else sp.top_k
        if top_k < -1:
            raise bad_request(
                f"top_k must be -1 (disable) or at least 1, got {top_k}.",
                _sampling_param("top_k", i),
            )
        if top_k == -1 or top_k >= min(TOP_K_ALL, st.vocab_size):
            top_k = 0
        temperature = 1.0 if sp.temperature is None else sp.temperature
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        width = sp.beam_width
        if width is not None and width < 1:
            raise bad_request(
                f"beam_width must be at least 1, got {width}.", _sampling_param("beam_width", i)
            )
        beam_width = width if width is not None and width > 1 else 0
        guided, guided_param = _guided(sp, i)
        prompt_logprobs = prompt_start = None
        if logprobs is not None and logprobs.start + 1 < len(ids):
            # SGLang's entry for the token at logprob_start_len has no value (None); the
            # engine's values begin with the next token
            prompt_logprobs, prompt_start = logprobs.top, logprobs.start + 1
        try:
            params = SamplingParams(
                n=sp.n or 1,
                temperature=temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                top_k=top_k,
                min_p=sp.min_p or 0.0,
                max_tokens=engine_max,
                stop=tuple(stops),
                stop_token_ids=tuple(stop_ids),
                include_stop_str_in_output=bool(sp.no_stop_trim),
                ignore_eos=bool(sp.ignore_eos),
                seed=sp.sampling_seed,
                skip_special_tokens=sp.skip_special_tokens is not False,
                logprobs=None if logprobs is None else logprobs.top,
                logprob_token_ids=() if logprobs is None else logprobs.token_ids,
                prompt_logprobs=prompt_logprobs,
                prompt_logprobs_start=prompt_start or 0,
                min_tokens=min_new,
                logit_bias=bias,
                presence_penalty=sp.presence_penalty or 0.0,
                frequency_penalty=sp.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if sp.repetition_penalty is None else sp.repetition_penalty
                ),
                priority=priority,
                guided=guided,
                beam_width=beam_width,
            )
        except (ValueError, TypeError) as e:  # the message starts with the engine's field name
            message = str(e)
            first = message.split(" ", 1)[0].split("=", 1)[0]
            if first in _TOP_LEVEL_NAMES:
                param = _TOP_LEVEL_NAMES[first]
            elif first == "guided" and guided_param:
                param = guided_param
            else:
                name = _ENGINE_NAMES.get(first, first)
                param = _sampling_param(name, i) if name in SAMPLING_FIELDS else None
            raise bad_request(message, param) from None
        return params, max_new, guided_param or None

    def lora(self, name: str | None, param: str) -> str | None:
        """The loaded LoRA adapter ``lora_path`` names (None, "" or the served model's name:
        the base model); 400 naming what is loaded otherwise."""
        if not name or name == self.st.model_name:
            return None
        loaded = self.st.lora_names()
        if name in loaded:
            return name
        shown = ", ".join(repr(n) for n in loaded[:20]) or "none"
        raise bad_request(
            f"lora_path {name!r} is not a loaded LoRA adapter (loaded: {shown}); load it with "
            "POST /v1/load_lora_adapter or radixkv serve --lora-modules",
            param,
        )

    def namespace(self, salt: str | None, key: str | None, at: int | None) -> Any:
        """The prompt's prefix-cache namespace: the tenant's, narrowed by ``cache_salt`` as on
        the OpenAI routes (the same salt shares their cache), and by ``extra_key``."""
        for name, value in (("cache_salt", salt), ("extra_key", key)):
            if value is not None and len(value) > 256:
                raise bad_request(f"{name} must be at most 256 characters", _field(name, at))
        salt = salt or None  # SGLang: empty means unset
        base = self.principal.namespace(salt)
        if not key:
            return base
        # a longer tuple than any (tenant, salt): cannot meet an OpenAI-route namespace
        return (self.principal.tenant, salt or "", "extra_key", key)
