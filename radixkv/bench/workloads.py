"""The token workloads of ``radixkv demo``, ``radixkv bench`` and bench/bench_engine.py: prompts
that share prefixes the way real traffic does (a system prompt per group, branches of one
prompt, chats resent with their history), seeded, as token ids."""

from __future__ import annotations

import random

from radixkv.model.tokenizer import Tokenizer

# The ``radixkv demo`` workload: many completions of one Python module. radixkv-tiny was trained
# on the Python standard library, so it can continue this; the module's docstring, imports and
# class header are the shared prefix (the "system prompt"), each request adds one method signature.
_MODULE_DOC = (
    "A small in-memory cache with a size limit. The cache keeps at most maxsize items and, when "
    "it is full, removes the entry that was used least recently. Every method is safe to call "
    "from several threads, because each one holds the lock while it reads or changes the "
    "mapping. Keys must be hashable; values may be any object. The statistics attribute counts "
    "hits, misses and evictions, so that the caller can tell whether the limit is large enough "
    "for the workload. Entries are stored in an ordered dictionary: the most recently used key "
    "is moved to the end, so the least recently used one is always first and can be removed in "
    "constant time. The size limit may be changed at any time with resize(), which drops the "
    "oldest entries until the cache fits. A value of None is stored like any other value; use a "
    "sentinel to tell a missing key from a stored None. Iterating over the cache does not count "
    "as use and does not change the order of the entries. The class does not expire entries "
    "after a time; store a timestamp with the value if that is needed. This module is an "
    "example for the radixkv demo: many requests share the text above and below, and each asks "
    "for the body of a different method."
)
_MODULE_CODE = '''
import os
import sys
import threading
from collections import OrderedDict


class LRUCache:
    """A mapping that keeps at most *maxsize* items, dropping the least recently used."""

    def __init__(self, maxsize=128):
        self.maxsize = maxsize
        self.data = OrderedDict()
        self.lock = threading.RLock()
        self.hits = self.misses = 0
'''
_METHODS = [
    "get", "put", "pop", "clear", "copy", "keys", "items", "values", "update", "resize",
    "discard", "setdefault", "__len__", "__contains__", "__repr__", "__iter__",
]  # fmt: skip
_ARGS = ["self", "self, key", "self, key, default=None"]


def shared_module_prompts(
    tokenizer: Tokenizer, *, num_requests: int, system_words: int, seed: int = 0
) -> list[list[int]]:
    """Token prompts that share one Python module (a docstring of ``system_words`` words, imports
    and a class header) and differ in the method signature that ends them (plus the body's
    indentation): the model writes that method's body. Requests past the 48 distinct signatures repeat them (full cache hits)."""
    import textwrap

    rng = random.Random(seed)
    words = _MODULE_DOC.split()
    doc = textwrap.fill(" ".join(words[i % len(words)] for i in range(system_words)), 80)
    module = f'"""{doc}\n"""\n{_MODULE_CODE}'
    sigs = [f"{m}({a})" for a in _ARGS for m in _METHODS]
    rng.shuffle(sigs)
    return [
        tokenizer.encode(
            f"{module}\n    def {sigs[i % len(sigs)]}:\n        "
        )  # as an editor indents
        for i in range(num_requests)
    ]


def shared_prefix_tokens(
    *, num_requests: int, prefix_len: int, unique_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``num_requests`` token prompts: one shared ``prefix_len`` prefix + ``unique_len`` own."""
    rng = random.Random(seed)
    hi = min(vocab, 256)  # plain byte ids: valid for every tokenizer we ship
    prefix = [rng.randrange(hi) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(hi) for _ in range(unique_len)] for _ in range(num_requests)]


def generated_shared_prefix(
    *,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    vocab: int,
    seed: int = 0,
) -> tuple[list[list[int]], float]:
    """SGLang's generated-shared-prefix shape: groups of prompts sharing a per-group system
    prompt, each with its own question, shuffled. Returns (prompts, ideal hit rate), the ideal
    being every system prompt computed once: (n - groups) * system / total prompt tokens."""
    rng = random.Random(seed)
    hi = min(vocab, 256)
    prompts = []
    for _ in range(num_groups):
        system = [rng.randrange(hi) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            prompts.append(system + [rng.randrange(hi) for _ in range(question_len)])
    rng.shuffle(prompts)
    n = len(prompts)
    ideal = (n - num_groups) * system_len / (n * (system_len + question_len))
    return prompts, ideal


def random_prompts(*, num_requests: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` independent token prompts of ``length`` ids: nothing to share."""
    rng = random.Random(seed)
    hi = min(vocab, 256)
    return [[rng.randrange(hi) for _ in range(length)] for _ in range(num_requests)]


def multi_turn_chats(
    *,
    num_chats: int,
    turns: int,
    system_len: int,
    user_len: int,
    assistant_len: int,
    vocab: int,
    seed: int = 0,
) -> tuple[list[list[int]], float]:
    """Chats resent with their history, as a chat client sends them: turn t of a chat is a
    system prompt every chat shares, the t - 1 earlier exchanges (user turn + answer) and the
    new user turn. Returns (prompts, ideal hit rate). The earlier answers are fixed tokens, not
    what a model wrote, so what a cache can reuse of turn t is turn t - 1's prompt (and, for a
    chat's first turn, the system prompt once another chat computed it)."""
    rng = random.Random(seed)
    hi = min(vocab, 256)

    def toks(n: int) -> list[int]:
        return [rng.randrange(hi) for _ in range(n)]

    system = toks(system_len)
    prompts: list[list[int]] = []
    reusable = 0
    for chat in range(num_chats):
        history = list(system)
        for t in range(turns):
            prompt = history + toks(user_len)
            reusable += len(history) - assistant_len if t else (len(system) if chat else 0)
            prompts.append(prompt)
            history = prompt + toks(assistant_len)
    return prompts, reusable / sum(map(len, prompts))
