"""The tokenizer of a GGUF file, rebuilt with ``tokenizers`` from the file's metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``), the
merges or the SentencePiece scores, each token's type, the special token ids, the BOS/EOS rules
and the chat template under llama.cpp's keys. Two kinds are rebuilt:

- ``tokenizer.ggml.model = gpt2``: byte-level BPE. How text is split before the merges is not in
  the file, only a name (``tokenizer.ggml.pre``) llama.cpp maps to its pre-tokenizer; the names
  radixkv knows are :data:`PRE_TOKENIZERS`, each the split its vocabulary was trained with.
- ``tokenizer.ggml.model = llama``: a SentencePiece-style BPE vocabulary (Llama 2, Mistral),
  spaces spelled U+2581, unknown bytes as ``<0xNN>`` tokens, merges recovered from the scores
  when the file lists none.

Tokens of type CONTROL (and UNKNOWN) become special added tokens, USER_DEFINED ones plain added
tokens, so both are matched whole in the text as llama.cpp does.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from radixkv.model.errors import ModelLoadError
from radixkv.model.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from radixkv.model.gguf import GGUFCheckpoint

# llama.cpp's token types (tokenizer.ggml.token_type)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

# The pre-tokenizer splits, as regular expressions over the text (facts of each vocabulary)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (kind, split regex or None). "gpt2": GPT-2's own split (ByteLevel's
# regex); "digits": every digit alone, then GPT-2's split (StarCoder, SmolLM); "regex": the
# given split, then the byte-level mapping; ignore_merges for Llama 3 (a word that is a
# vocabulary token is taken whole, as its tokenizer.json says)
PRE_TOKENIZERS: dict[str, tuple[str, str | None]] = {
    "default": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "gpt-2": ("gpt2", None),
    "phi-2": ("gpt2", None),
    "smollm": ("digits", None),
    "starcoder": ("digits", None),
    "refact": ("digits", None),
    "llama-bpe": ("llama3", _LLAMA3_SPLIT),
    "llama3": ("llama3", _LLAMA3_SPLIT),
    "llama-v3": ("llama3", _LLAMA3_SPLIT),
    "smaug-bpe": ("llama3", _LLAMA3_SPLIT),
    "dbrx": ("llama3", _LLAMA3_SPLIT),
    "falcon3": ("llama3", _LLAMA3_SPLIT),
    "qwen2": ("regex", _QWEN2_SPLIT),
    "deepseek-r1-qwen": ("regex", _QWEN2_SPLIT),
    "megrez": ("regex", _QWEN2_SPLIT),
}
TOKENIZER_MODELS = ("gpt2", "llama")


def gguf_tokenizer(ckpt: GGUFCheckpoint) -> HFTokenizer:
    """The tokenizer ``ckpt``'s metadata describes, with its chat template, BOS/EOS strings and
    EOS ids (``eos_token_id``, and ``eot_token_id`` / ``eom_token_id`` where the file has
    them: chat models end a turn with those). ModelLoadError naming the key otherwise."""
    from tokenizers import AddedToken, Tokenizer, processors

    file = str(ckpt.path)
    model = ckpt.field("tokenizer.ggml.model", required=True)
    tokens: list[str] = list(ckpt.field("tokenizer.ggml.tokens", required=True))
    types: list[int] = list(ckpt.field("tokenizer.ggml.token_type") or [1] * len(tokens))
    if model == "gpt2":
        raw: Tokenizer = _byte_level(ckpt, tokens)
    elif model == "llama":
        raw = _sentencepiece(ckpt, tokens)
    else:
        raise ModelLoadError(
            file,
            "tokenizer.ggml.model",
            f"unsupported tokenizer {model!r}; supported: {', '.join(TOKENIZER_MODELS)}",
        )
    alphabet = _byte_alphabet() if model == "gpt2" else None
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        # a byte-level vocabulary spells every real token in its alphabet: a CONTROL token
        # spelled otherwise is a mislabelled piece of text, not a token to match whole
        if kind in (CONTROL, UNKNOWN) and (alphabet is None or set(t) <= alphabet)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind == USER_DEFINED
    ]
    raw.add_special_tokens(special)
    raw.add_tokens(user)

    def token(key: str) -> tuple[int | None, str | None]:
        i = ckpt.field(f"tokenizer.ggml.{key}")
        if i is None:
            return None, None
        if not 0 <= int(i) < len(tokens):
            raise ModelLoadError(file, f"tokenizer.ggml.{key}", f"token id {i} out of range")
        return int(i), tokens[int(i)]

    bos_id, bos = token("bos_token_id")
    eos_id, eos = token("eos_token_id")
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise
    add_bos = bool(ckpt.field("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(ckpt.field("tokenizer.ggml.add_eos_token", False))
    before = [bos] if add_bos and bos else []
    after = [eos] if add_eos and eos else []
    pieces = {t: i for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None and i is not None}
    raw.post_processor = processors.TemplateProcessing(
        single=[*before, "$A", *after],
        pair=[*before, "$A", *after, *before, "$B:1", *after],
        special_tokens=list(pieces.items()),
    )
    eos_ids = [i for i in (eos_id, token("eot_token_id")[0], token("eom_token_id")[0])
               if i is not None]  # fmt: skip
    template = ckpt.field("tokenizer.chat_template")
    return HFTokenizer(
        raw,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos,
        eos_token=eos,
    )


def _byte_level(ckpt: GGUFCheckpoint, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    pre = ckpt.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            str(ckpt.path),
            "tokenizer.ggml.pre",
            f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}",
        )
    kind, split = PRE_TOKENIZERS[pre]
    alphabet = _byte_alphabet()
    to_char = _byte_to_char()
    # tokens outside the byte alphabet (plain-text added tokens in some files) are respelled
    vocab = {
        (t if set(t) <= alphabet else "".join(to_char[b] for b in t.encode())): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in ckpt.field("tokenizer.ggml.merges") or []]
    raw = Tokenizer(BPE(vocab, merges, ignore_merges=kind == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if kind == "digits":
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif split is not None:
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    else:
        raw.pre_tokenizer = byte_level
    raw.decoder = decoders.ByteLevel()
    return raw


def _sentencepiece(ckpt: GGUFCheckpoint, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    listed = ckpt.field("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        scores = ckpt.field("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                str(ckpt.path), "tokenizer.ggml.scores", "needed (one per token) without merges"
            )
        merges = merges_from_scores(tokens, [float(s) for s in scores])
    unk_id = ckpt.field("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    raw = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(ckpt.field("tokenizer.ggml.add_space_prefix", True))
    # a space in front of the text (not after each special token), spaces spelled U+2581
    raw.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    raw.decoder = decoders.Sequence(
        [*steps, decoders.Strip(content=" ", left=1, right=0)] if prefix else steps
    )
    return raw


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, recovered from its vocabulary: every way of cutting a
    token into two tokens is a merge, ranked by the merged token's score (higher first; ties:
    the lower token id, then the longer left part)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


@cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte alphabet, byte -> character (the inverse of tokenizer.py's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in printable}
    others = sorted(set(range(256)) - set(printable))
    out.update({b: chr(256 + k) for k, b in enumerate(others)})
    return out


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_to_char().values())
