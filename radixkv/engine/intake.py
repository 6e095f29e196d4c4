"""Request intake: a submitted prompt + params checked once, then turned into a ``RequestGroup``.

This is the only place a request's input is validated: the scheduler, the model runner and the
attention backends trust what gets past it (their own re-checks are debug-only, radixkv/debug.py).

Contract: ``RequestIntake.check`` validates everything about a request that does not depend on
the engine's live state (params type, prompt, token ids inside the vocabulary, context length,
whether the KV pool could ever hold it, namespace hashability) and mutates nothing, so a
rejected request leaves the engine unchanged. ``RequestIntake.build`` makes the group and its
``params.n`` sequences (each with its sampling generator and detokenizer); it draws seeds from
the intake's own RNG (seeded from ``EngineConfig.seed``) and touches nothing else. Request ids
and the live-request table stay with the engine, which assigns the id between the two calls.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from radixkv.engine.config import EngineConfig
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.guided import GuideCompiler
from radixkv.engine.lora import LoRAInfo
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import Namespace, RequestGroup, Sequence
from radixkv.engine.sampler import UniformStream, make_generator
from radixkv.model.tokenizer import Tokenizer
from radixkv.pages import pages_for

log = logging.getLogger(__name__)

# What ``Engine.add_request`` accepts as a prompt: text (tokenised by the engine's tokenizer) or
# token ids (a list or tuple of ints; numpy arrays and tensors are converted with ``tolist()``).
Prompt = str | SequenceABC[int]


class PriorityNeedsPolicy(ValueError):
    """A request gave ``priority`` (not 0) to an engine whose ``schedule_policy`` is not
    ``"priority"``: under the other policies every request's priority is 0 (the scheduler
    relies on it). ``priority``: the value given, for a front end that words the error in its
    own API's terms."""

    def __init__(self, priority: int) -> None:
        super().__init__(
            f"priority={priority} needs schedule_policy='priority' "
            "(--schedule-policy priority); under the other policies it must be 0"
        )
        self.priority = priority


def normalise_prompt(
    prompt: object, tokenizer: Tokenizer, vocab_size: int
) -> tuple[str | None, list[int]]:
    """Returns ``(text or None, token ids)``.

    Raises:
        ValueError: empty prompt, a token id outside ``[0, vocab_size)``, a non-integer id.
        TypeError: a prompt that is neither text nor a sequence of ints.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        return prompt, list(ids)
    if hasattr(prompt, "tolist") and not isinstance(prompt, list | tuple):
        prompt = prompt.tolist()  # numpy array / torch tensor
    if not isinstance(prompt, list | tuple):
        raise TypeError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not prompt:
        raise ValueError("prompt is empty")
    ids = []
    for i, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompt token {i} is not an int: {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} = {t} is outside the vocabulary [0, {vocab_size})")
        ids.append(t)
    return None, ids


def as_prompt_list(prompts: object) -> list[Prompt]:
    """One prompt (text or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, list | tuple):
        prompts = prompts.tolist()
    if not isinstance(prompts, Iterable):
        raise TypeError(
            "prompts must be a string, a list of strings or of token-id lists, "
            f"got {type(prompts).__name__}"
        )
    plist = list(prompts)
    if not plist:
        raise ValueError("prompts is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in plist):
        return [plist]  # one tokenised prompt
    return plist


class RequestIntake:
    """Validates requests against the model and pool limits and builds their groups."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_context: int,
        num_pages: int,
        guides: GuideCompiler,
    ) -> None:
        self.tokenizer = tokenizer
        self.guides = guides  # compiles SamplingParams.guided (guided.py)
        self.priority_scheduling = config.schedule_policy == "priority"
        self.max_running = config.max_running_requests
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.page_size = config.page_size
        self.num_pages = num_pages
        self._rng = random.Random(config.seed)
        self._special_prefix = _special_prefix(tokenizer)
        self._warned_double_bos = False
        # decode([id]) per skip_special_tokens, shared by every detokenizer (they decode each
        # new token's text alone once it is complete: detokenizer.py)
        self._one_token_texts: dict[bool, dict[int, str]] = {False: {}, True: {}}
        # ... and what a token appends after a complete one (the usual step), per pair
        self._pair_texts: dict[bool, dict[int, str | None]] = {False: {}, True: {}}

    def check(
        self, prompt: object, params: SamplingParams | None, namespace: object
    ) -> tuple[SamplingParams, str | None, list[int]]:
        """Returns ``(params, prompt text or None, prompt token ids)``; ``None`` params become
        the defaults. Raises ValueError/TypeError on bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.priority and not self.priority_scheduling:  # the one place this is checked
            raise PriorityNeedsPolicy(params.priority)
        if params.beam_width > self.max_running:  # its beams run at once (scheduler.py)
            raise ValueError(
                f"beam_width={params.beam_width} exceeds max_running_requests="
                f"{self.max_running}: the beams of a request run at once"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {self.vocab_size}")
        bad = [t for t in params.logprob_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logprob_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})"
            )
        if params.guided is not None:
            self.guides.compile(params.guided)  # raises ValueError naming what cannot be used
        text, ids = normalise_prompt(prompt, self.tokenizer, self.vocab_size)
        start = params.prompt_logprobs_start
        if start and start >= len(ids):
            raise ValueError(
                f"prompt_logprobs_start={start} must be less than the prompt's length "
                f"({len(ids)} tokens)"
            )
        if text is not None:
            self._check_double_bos(ids)
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length {self.max_context}"
            )
        need = pages_for(total, self.page_size)
        if need > self.num_pages:
            raise ValueError(
                f"request needs {need} KV pages for {total} tokens but the pool has only "
                f"{self.num_pages}: it could never fit"
            )
        try:
            hash(namespace)
        except TypeError:
            raise TypeError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        return params, text, ids

    def _check_double_bos(self, ids: list[int]) -> None:
        """Warn (once) when a text prompt starts with the tokenizer's added special tokens
        twice: the text already began with them (typically a rendered chat template, which
        writes its own BOS) and encoding added them again. Engine.chat encodes conversations
        without adding them, as the server does."""
        pre = self._special_prefix
        if not pre or self._warned_double_bos or ids[: 2 * len(pre)] != pre + pre:
            return
        self._warned_double_bos = True
        log.warning(
            "a text prompt starts with %s twice: the text already has it (a rendered chat "
            "template?) and encoding added it again; use Engine.chat(messages) or pass token "
            "ids (logged once)",
            self.tokenizer.decode(pre),
        )

    def build(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        namespace: Namespace,
        stream: bool,
        arrival_time: float | None,
        lora: LoRAInfo | None = None,
    ) -> RequestGroup:
        """A group of ``params.n`` waiting sequences (one for beam search: its beams branch
        from it, beam_runner.py; inputs already passed ``check``), run with
        the LoRA adapter ``lora`` (None: the base model)."""
        now = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, text, ids, params, namespace, now, stream, lora)
        # without streaming or stop strings, text is decoded once at the end (Engine._finish)
        live_detok = stream or bool(params.stop)
        for i in range(params.num_initial_seqs):
            gen = None
            if params.temperature > 0:
                seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
                gen = UniformStream(make_generator(seed))
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
                self._one_token_texts[params.skip_special_tokens],
                self._pair_texts[params.skip_special_tokens],
            )
            seq = Sequence(group, i, ids, gen, detok)
            seq.live_detok = live_detok
            if params.guided is not None:  # compiled in check(): a cache hit here
                seq.guide = self.guides.guide(params.guided, allow_eos=not params.ignore_eos)
            group.seqs.append(seq)
        return group


def _special_prefix(tokenizer: Tokenizer) -> list[int]:
    """The ids ``encode(text)`` puts in front of the text (BOS for most tokenizers; none for
    Qwen's, say), found by encoding one letter with and without special tokens."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a"))
    n = len(full) - len(plain)
    return full[:n] if n > 0 and full[n:] == plain else []
