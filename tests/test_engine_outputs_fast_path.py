"""``RequestGroup.make_output``'s inline path for a single sample against the general one
(``_sample_outputs``): at every step of a streaming run (stop strings held back, logprobs,
every finish reason), the same outputs and the same cursors after."""

from __future__ import annotations

import random

import pytest

from radixkv.engine.engine import Engine
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import RequestGroup


def _state(g: RequestGroup) -> tuple[list[int], list[int]]:
    return list(g._emitted_tokens), [s.detok._emitted for s in g.seqs]


def _restore(g: RequestGroup, st: tuple[list[int], list[int]]) -> None:
    g._emitted_tokens = list(st[0]) or [0] * len(g.seqs)  # (sized by the first output)
    for s, e in zip(g.seqs, st[1]):
        s.detok._emitted = e


def test_single_sample_output_is_the_general_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = []
    make = RequestGroup.make_output

    def both(g: RequestGroup) -> RequestOutput:
        """The output as the engine makes it, checked against the general path's."""
        st = _state(g)
        fast = make(g)
        after = _state(g)
        _restore(g, st)
        assert g.beam is None and len(g.seqs) == 1
        ref = g._sample_outputs()
        assert _state(g) == after
        assert fast.outputs == ref, g.request_id
        first = ref[0]
        assert (fast.text, fast.token_ids, fast.finish_reason) == (
            first.text, first.token_ids, first.finish_reason,
        )  # fmt: skip
        assert fast.finished == (first.finish_reason is not None)
        checked.append(first.finish_reason)
        return fast

    monkeypatch.setattr(RequestGroup, "make_output", both)
    rng = random.Random(0)
    eng = Engine("radixkv-tiny-random", page_size=4, num_pages=400)
    for i in range(24):
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randrange(1, 20),
            stop=rng.choice([[], ["a"], ["e ", "th"], [chr(c) for c in range(33, 127, 3)]]),
            stop_token_ids=rng.choice([[], list(range(0, 256, 9))]),
            logprobs=rng.choice([None, 2]), ignore_eos=rng.random() < 0.5,
        )  # fmt: skip
        prompt = bytes(rng.randrange(97, 123) for _ in range(rng.randrange(1, 12))).decode()
        eng.add_request(prompt, params, stream=rng.random() < 0.8)
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished() and len(checked) > 100
    assert {"stop", "length"} <= set(checked)
    eng.check_invariants()


def test_outputs_keep_the_batch_order_and_non_streams_report_once() -> None:
    """Requests that do not stream are recorded only when they finish: each step's outputs
    still come in the order of the requests' first rows in the batch, and a request that
    does not stream has exactly one output, its final one."""
    rng = random.Random(3)
    eng = Engine("radixkv-tiny-random", page_size=4, num_pages=600)
    stream: dict[str, bool] = {}
    for i in range(30):
        params = SamplingParams(
            temperature=1.0, seed=i, n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(1, 12),
            stop_token_ids=list(range(0, 256, 11)),
        )  # fmt: skip
        s = rng.random() < 0.5
        stream[eng.add_request(list(range(40, 40 + rng.randrange(2, 9))), params, stream=s)] = s
    schedule = eng.scheduler.schedule
    order: list[str] = []

    def recorded() -> object:
        batch = schedule()
        order[:] = list(dict.fromkeys(s.group.request_id for s in batch.seqs))
        return batch

    eng.scheduler.schedule = recorded  # type: ignore[method-assign]
    seen: dict[str, int] = {}
    while eng.has_unfinished():
        ids = [o.request_id for o in eng.step()]
        assert ids == [r for r in order if r in ids]  # the batch's order
        for o in eng.drain() or ():
            raise AssertionError(o)
        for rid in ids:
            seen[rid] = seen.get(rid, 0) + 1
    for rid, s in stream.items():
        assert seen[rid] >= 1 if s else seen[rid] == 1, rid
    eng.check_invariants()


def test_output_ids_follow_a_changed_output() -> None:
    """The output ids kept between outputs (``Sequence.out_list``) follow the sequence's
    tokens even if they shrink or change (not in normal operation), and the lists handed out
    are the user's: changing one changes nothing else."""
    eng = Engine("radixkv-tiny-random", page_size=4, num_pages=100)
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), stream=True)
    group = eng._live[rid]
    seq = group.seqs[0]
    rng = random.Random(5)
    for step in range(12):
        eng.step()
        n0 = seq.num_prompt_tokens
        if step % 3 == 2:  # the tail replaced behind the output's back
            del seq.token_ids[-2:]
            seq.token_ids.extend([rng.randrange(256), rng.randrange(256)])
        if step % 4 == 3:
            del seq.token_ids[-1:]
        out = group.make_output()
        assert out.token_ids == seq.token_ids[n0:].tolist() == out.outputs[0].token_ids
        out.token_ids.append(-1)  # the user's list
        out.outputs[0].delta_token_ids.clear()
        assert group.make_output().token_ids == seq.token_ids[n0:].tolist()
    eng.abort(rid)
    eng.check_invariants()
