"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def is_int(x: object) -> bool:
    """An int that is not a bool (JSON's true would pass as 1 otherwise)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class GuidedDecodingParams:
    """What the output must match (vLLM's guided decoding); exactly one of:

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value it
            accepts, properties in the schema's order. Normalised to compact JSON text.
        json_object: True: the output is any JSON object (OpenAI's ``json_object`` mode).
        regex: a regular expression the whole output matches (Rust ``regex`` syntax, as
            outlines-core reads it: no lookaround, no backreferences).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar the whole output is a sentence of (vLLM's
            ``guided_grammar``): Lark as llguidance reads it (``start: ...``, what vLLM's
            ``guidance`` backend takes), or GBNF/EBNF as llama.cpp and xgrammar write it
            (``root ::= ...``; told apart by a rule defined with ``::=``). llguidance compiles
            it: terminals are matched greedily (longest first), as its lexer does.
        whitespace_pattern: for ``json`` and ``json_object`` only, the regex of the whitespace
            allowed between JSON tokens; None: at most one space (outlines-core's default,
            which keeps small models from rambling in blank space).
        start_after: None: the whole output is constrained. Else the output is free up to
            and including the first occurrence of this text (a thinking model's end tag,
            ``"</think>"``: the server sets it for a prompt that opens a reasoning block), and
            the constraint holds from the next token on. The text is matched on the sampled
            tokens' bytes; a token that spells the text and more (``"</think>{"``) puts
            that more in the free part.

    The engine compiles it against the tokenizer's vocabulary when the request is added
    (engine/guided.py); an unsupported schema, a grammar with an error or a language no token
    sequence can spell raises ValueError there.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, v in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json, json_object, regex, choice and "
                f"grammar, got {given or 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _normalise_schema(self.json))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str) or not isinstance(c, Sequence) or not c:
                raise ValueError(f"choice must be a non-empty list of strings, got {c!r}")
            if not all(isinstance(x, str) and x for x in c):
                raise ValueError(f"choice must hold non-empty strings, got {list(c)!r}")
            object.__setattr__(self, "choice", tuple(c))
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise ValueError(f"grammar must be a non-empty string, got {self.grammar!r}")
        w = self.whitespace_pattern
        if w is not None and (not isinstance(w, str) or not w):
            raise ValueError(f"whitespace_pattern must be a non-empty string, got {w!r}")
        if w is not None and self.json is None and not self.json_object:
            raise ValueError(
                f"whitespace_pattern applies to json and json_object, not to {given[0]}"
            )
        a = self.start_after
        if a is not None and (not isinstance(a, str) or not a):
            raise ValueError(f"start_after must be a non-empty string, got {a!r}")


def _normalise_schema(schema: object) -> str:
    value: Any = schema
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"json must be a JSON schema, got text that is not JSON: {e}"
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(f"json must be a JSON schema (an object), got {type(value).__name__}")
    try:
        # key order kept: a schema's property order is the order the output writes them in
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"json must be a JSON schema: {e}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample the continuation of one prompt.

    Attributes:
        n: number of samples; they share the prompt's KV (the prompt is prefilled once).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; 0 (or -1) disables it.
        min_p: drop tokens whose probability (after temperature) is below ``min_p`` times the
            most likely token's, in [0, 1]; 0 disables it. Applied before top-k and top-p, as
            vLLM does.
        max_tokens: most tokens to generate (>= 1).
        stop: strings that end the output when they appear; the stop string is not included
            (unless ``include_stop_str_in_output``). A single string or a sequence of strings;
            normalised to a tuple.
        include_stop_str_in_output: keep the stop string that ended the output at the end of
            its text (vLLM's).
        stop_token_ids: token ids that end the output (the token is kept in ``token_ids``,
            not in ``text``).
        ignore_eos: keep generating past the model's EOS tokens.
        seed: per-request seed; the same seed gives the same samples (sample i of an n > 1
            request uses ``seed + i``). None draws from the engine's seeded generator.
        skip_special_tokens: leave special tokens (chat markers, EOS) out of ``text``, as
            vLLM and SGLang do by default; ``token_ids`` always keeps them.
        min_tokens: the output's EOS tokens (unless ``ignore_eos``) and ``stop_token_ids`` are
            held back until it has this many tokens (vLLM's), 0 to ``max_tokens``; a stop
            string may still end it earlier.
        logit_bias: ``{token_id: bias}`` added to those tokens' logits at every step (OpenAI's,
            bias in [-100, 100]); normalised to a sorted tuple of pairs.
        presence_penalty: subtracted from the logit of every token the output already holds,
            in [-2, 2] (OpenAI's range); 0 disables it.
        frequency_penalty: times each token's count in the output so far, subtracted from its
            logit, in [-2, 2]; 0 disables it.
        repetition_penalty: logits of tokens in the prompt or the output so far are divided
            by it where positive and multiplied by it where negative (Hugging Face's and
            vLLM's), > 0; 1 disables it, above 1 discourages repeats. The three apply to the
            raw logits before temperature and filtering, so greedy decoding feels them too
            (engine/logit_adjust.py, with ``logit_bias`` and ``min_tokens``).
        logprobs: None (default) returns no log probabilities and costs nothing. An int k >= 0
            returns, for every output token, the log probability of the sampled token and of
            the k most likely tokens at that step (0: the sampled token only), in
            ``CompletionOutput.logprobs``, as vLLM does. They are the model's own distribution
            (``log_softmax`` of the step's logits), before temperature, top-k/top-p/min-p
            filtering: what vLLM returns by default (its ``raw_logprobs``), so they do not
            depend on how the token was chosen.
        prompt_logprobs: None (default) or an int k >= 0: the log probability of every prompt
            token given the tokens before it, and of the k most likely tokens at that
            position, in ``RequestOutput.prompt_logprobs`` (vLLM's; the first token has none).
            Computing them needs the model's output at every prompt position, so such a
            request reuses no cached prefix before ``prompt_logprobs_start``: that part of its
            prompt is prefilled again (and cached as usual). Raw values, like ``logprobs``.
        prompt_logprobs_start: the first prompt token that gets a prompt logprob (SGLang's
            ``logprob_start_len``); the entries before it are None. Scoring a continuation after
            a shared context (few-shot examples, multiple-choice answers, a document) then
            reuses the cached context: only from ``start - 1`` on must the model's outputs be
            computed. 0 (default) and 1 both mean from the second token; needs
            ``prompt_logprobs``; must be less than the prompt's length (checked at submission).
        logprob_token_ids: token ids whose log probability joins every logprobs entry the
            request returns (output tokens with ``logprobs``, prompt tokens with
            ``prompt_logprobs``), each with its rank, after the position's own token and its
            top alternatives (SGLang's ``token_ids_logprob``): the probability of "Yes" and
            "No" after a question, of each label after a document. Needs ``logprobs`` or
            ``prompt_logprobs``; ids below the vocabulary size (checked at submission);
            normalised to a tuple without repeats, in the given order.
        priority: the request's scheduling priority under ``schedule_policy="priority"``:
            lower values go first (vLLM's convention), arrival order among equals; a waiting
            request may preempt running ones of a lower priority (higher value) to get in.
            Must stay 0 under the other policies (checked at submission).
        guided: a :class:`GuidedDecodingParams` (or a dict of its fields): the output is
            constrained to match it, a JSON schema, any JSON object, a regex, one of some
            strings or a context-free grammar (tokens that cannot continue a match get no
            probability; penalties and bias apply first; logprobs stay raw). The output ends
            ("stop") as soon as nothing but the end can follow. None (default): free text.
        beam_width: 0 (default) samples as above. W >= 1 runs beam search instead, with
            Hugging Face's ``generate(num_beams=W, do_sample=False)`` semantics
            (engine/beam_search.py, run by beam_runner.py): W beams are kept, each step every beam's continuations
            are ranked by total log probability, and the request returns the ``n`` best
            finished hypotheses (``n`` <= W), best first, with their scores in
            ``CompletionOutput.cumulative_logprob`` and ``.score``. The beams share the
            prompt's and each other's pages through the prefix cache (with the cache off, a
            fork copies its beam's pages). The search is
            deterministic: temperature, top-k/top-p/min-p and seed are not used. Stop strings,
            penalties and ``logit_bias`` cannot be combined with it (ValueError);
            ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and ``logprobs`` apply (each
            hypothesis's tokens get their entries, under the beam that chose them), and so
            does ``guided``: each beam walks its own copy of the language, and the tokens it
            refuses a beam get no score there (Hugging Face's ``prefix_allowed_tokens_fn``:
            the log probabilities of the others are not renormalised).
        length_penalty: beam search only: a finished hypothesis scores its total log
            probability divided by (its output length ** length_penalty) (Hugging Face's);
            above 0 favours longer outputs, below 0 shorter ones.
        early_stopping: beam search only (Hugging Face's): False (default) stops when no beam
            can still beat the W best finished hypotheses at its current length; True stops
            as soon as W hypotheses are finished; "never" only when no beam could beat them
            even at ``max_tokens`` (with ``length_penalty`` > 0).
        tenant: who the request is for, for fair admission (engine/schedule_policy.py): the
            scheduler interleaves waiting requests of different tenants and caps each
            tenant's running ones (``EngineConfig.tenant_max_running``). None (default): the
            engine user's own requests, all one tenant (admitted exactly as without it). The
            server sets it from the API key. It does not partition the prefix cache (the
            namespace does).

    Raises:
        ValueError: on any out-of-range value or wrongly typed field (the message names it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default=())
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    logprob_token_ids: tuple[int, ...] = field(default=())
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    priority: int = 0
    guided: GuidedDecodingParams | None = None
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}"
            )
        if not isinstance(self.min_p, int | float) or isinstance(self.min_p, bool):
            raise ValueError(f"min_p must be a number, got {self.min_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}"
            )
        if not is_int(self.prompt_logprobs_start) or self.prompt_logprobs_start < 0:
            raise ValueError(
                f"prompt_logprobs_start must be an integer >= 0, got {self.prompt_logprobs_start!r}"
            )
        if self.prompt_logprobs_start and self.prompt_logprobs is None:
            raise ValueError("prompt_logprobs_start needs prompt_logprobs (None here)")
        lt = self.logprob_token_ids
        if lt is None:
            lt = ()
        if not isinstance(lt, Sequence) or isinstance(lt, str | bytes):
            raise ValueError(f"logprob_token_ids must be a list of ints, got {type(lt).__name__}")
        if not all(is_int(t) and t >= 0 for t in lt):
            raise ValueError(f"logprob_token_ids must be non-negative ints, got {list(lt)!r}")
        if lt and self.logprobs is None and self.prompt_logprobs is None:
            raise ValueError("logprob_token_ids needs logprobs or prompt_logprobs (both None here)")
        object.__setattr__(self, "logprob_token_ids", tuple(dict.fromkeys(int(t) for t in lt)))
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
            raise ValueError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
        if not all(is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                "include_stop_str_in_output must be a bool, got "
                f"{self.include_stop_str_in_output!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            object.__setattr__(self, name, float(v))
        rp = self.repetition_penalty
        if not isinstance(rp, int | float) or isinstance(rp, bool) or not math.isfinite(rp):
            raise ValueError(f"repetition_penalty must be a finite number, got {rp!r}")
        if rp <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {rp!r}")
        object.__setattr__(self, "repetition_penalty", float(rp))
        if not is_int(self.priority):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string or None, got {self.tenant!r}")
        g = self.guided
        if isinstance(g, Mapping):
            try:
                g = GuidedDecodingParams(**g)
            except TypeError as e:
                raise ValueError(f"guided: {e}") from None
            object.__setattr__(self, "guided", g)
        if g is not None and not isinstance(g, GuidedDecodingParams):
            raise ValueError(f"guided must be a GuidedDecodingParams or None, got {g!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        w, lp, es = self.beam_width, self.length_penalty, self.early_stopping
        if not is_int(w) or w < 0:
            raise ValueError(f"beam_width must be an integer >= 0 (0: no beam search), got {w!r}")
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        if not isinstance(es, bool) and es != "never":
            raise ValueError(f"early_stopping must be true, false or 'never', got {es!r}")
        if not w:
            if lp != 1.0 or es is not False:
                raise ValueError("length_penalty and early_stopping apply to beam search only")
            return
        if self.n > w:
            raise ValueError(f"n={self.n} exceeds beam_width={w}: beam search returns at most W")
        refused = [
            name
            for name, on in (
                ("stop strings", bool(self.stop)),
                ("penalties", self.has_penalties),
                ("logit_bias", bool(self.logit_bias)),
            )
            if on
        ]
        if refused:
            raise ValueError(f"beam search cannot be combined with {', '.join(refused)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the step's logits (engine/logit_adjust.py)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def num_initial_seqs(self) -> int:
        """Sequences the request starts with: ``n`` samples, or beam search's one beam (it
        branches into ``beam_width`` after the prompt)."""
        return 1 if self.beam_width else self.n

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or isinstance(stop, bytes):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    out: list[str] = []
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {type(s).__name__}: {s!r}")
        if not s:
            raise ValueError("stop strings must be non-empty")
        out.append(s)
    return tuple(out)


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound


def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (or pairs) as a sorted tuple of (int, float) pairs."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}")
        t, v = pair
        if not is_int(t) or t < 0:
            raise ValueError(f"logit_bias token ids must be non-negative ints, got {t!r}")
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"logit_bias values must be finite numbers, got {v!r} for {t}")
        if abs(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for {t}")
        out[t] = float(v)
    return tuple(sorted(out.items()))
