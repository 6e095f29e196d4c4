"""Output text leaves special tokens out by default; LPM's look-ahead changes nothing in the cache."""

from __future__ import annotations

import pytest

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("radixkv-tiny", page_size=4, num_pages=256, attention_backend="torch")


def _special_ids(eng: Engine) -> list[int]:
    tok = eng.tokenizer
    return [i for i in range(256, tok.vocab_size) if i not in tok.eos_token_ids]


def test_special_tokens_skipped_in_text_by_default(engine: Engine) -> None:
    special = _special_ids(engine)
    assert special, "radixkv-tiny has special tokens"
    prompt = list(b"special tokens: ")
    params_keep = SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True, skip_special_tokens=False
    )
    out = engine.generate([prompt], params_keep, use_tqdm=False)[0]
    first = out.token_ids[0]
    text_keep = engine.tokenizer.decode([first], skip_special_tokens=False)
    assert out.text == text_keep
    skipped = engine.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert skipped.token_ids == out.token_ids
    assert skipped.text == engine.tokenizer.decode([first], skip_special_tokens=True)
    if first in special:
        assert skipped.text == "" and out.text != ""
    # the decoder itself: a special id renders only when asked to
    sid = special[0]
    assert engine.tokenizer.decode([sid], skip_special_tokens=False) != ""
    assert engine.tokenizer.decode([sid], skip_special_tokens=True) == ""


@pytest.mark.parametrize("skip", [True, False])
def test_an_output_decoded_at_once_reads_as_one_decoded_as_it_goes(
    engine: Engine, skip: bool
) -> None:
    """Without streaming or stop strings an output is decoded once, when it ends; its text
    must be the streamed one, special tokens left out (or kept) alike."""
    sid = _special_ids(engine)[0]
    params = SamplingParams(
        temperature=0, max_tokens=3, logit_bias={sid: 100}, skip_special_tokens=skip
    )
    whole = engine.generate([list(b"x = ")], params, use_tqdm=False)[0]
    streamed = "".join(o.outputs[0].delta_text for o in engine.stream(list(b"x = "), params))
    assert whole.token_ids == [sid] * 3
    assert whole.text == streamed == ("" if skip else engine.tokenizer.decode([sid] * 3))


def test_skip_special_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="yes")  # type: ignore[arg-type]


def test_lpm_lookahead_does_not_touch_hit_counts() -> None:
    eng = Engine("radixkv-tiny", page_size=4, num_pages=256, attention_backend="torch")
    system = list(b"a shared system prompt for every request. ")
    eng.generate([system + list(b"warm")], SamplingParams(max_tokens=2, temperature=0), False)
    before = eng.cache.stats.match_queries
    hits_before = {id(n): n.hit_count for n in eng.cache.iter_nodes()}
    for i in range(6):
        eng.add_request(system + list(f"question {i}".encode()), SamplingParams(max_tokens=2))
    waiting = list(eng.scheduler.waiting)
    assert len(waiting) == 6
    assert all(eng.scheduler.kv.peek_match_len(seq) >= 40 for seq in waiting)
    assert eng.cache.stats.match_queries == before
    assert {id(n): n.hit_count for n in eng.cache.iter_nodes()} == hits_before
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(engine: Engine, stream: bool) -> None:
    prompt = "def add(a, b):\n"  # radixkv-tiny answers with a run of spaces, then code
    base = SamplingParams(temperature=0.0, max_tokens=24, stop=["   "])
    keep = SamplingParams(
        temperature=0.0, max_tokens=24, stop=["   "], include_stop_str_in_output=True
    )
    if stream:
        cut = "".join(o.outputs[0].delta_text for o in engine.stream(prompt, base))
        kept = "".join(o.outputs[0].delta_text for o in engine.stream(prompt, keep))
    else:
        cut = engine.generate([prompt], base, use_tqdm=False)[0].outputs[0].text
        kept = engine.generate([prompt], keep, use_tqdm=False)[0].outputs[0].text
    assert kept == cut + "   "  # the stop string, once, at the end
    assert "   " not in cut
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output=1)


def test_the_server_passes_include_stop_str_in_output_on() -> None:
    import httpx
    from server_helpers import MODEL, live_server

    body = {"model": MODEL, "prompt": "def add(a, b):\n", "max_tokens": 24, "temperature": 0}
    with live_server() as (srv, _), httpx.Client(base_url=srv.url, timeout=30) as http:
        texts = [
            http.post(
                "/v1/completions",
                json={**body, "stop": ["   "], "include_stop_str_in_output": keep},
            ).json()["choices"][0]["text"]
            for keep in (False, True)
        ]
    assert texts[1] == texts[0] + "   "
