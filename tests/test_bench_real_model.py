"""bench/bench_real_model.py's plumbing without the peers (llama-cpp-python is no test
dependency): its workloads on the real tokenizer, the agreement cut, the ratios and goals."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_real_model as brm  # noqa: E402

from radixkv.model.loader import load_tokenizer  # noqa: E402


def test_workloads_share_what_they_say() -> None:
    tok = load_tokenizer(brm.MODEL)
    asked: list[int] = []

    def history(prompts: list[list[int]], new: int) -> list[list[int]]:
        asked.append(len(prompts))
        answer = tok.encode("Start slowly.", add_special_tokens=False)
        return [answer + [brm.EOS] + [5] * (new - len(answer) - 1) for _ in prompts]

    w = brm.make_workloads(tok, quick=True, history=history)
    a, b, c = w["A_shared_prefix"], w["B_unrelated"], w["C_multi_turn"]
    assert len(a.prompts) == len(b.prompts) == 8 and a.new_tokens == 16
    assert all(p[: a.shared_prefix] == a.prompts[0][: a.shared_prefix] for p in a.prompts)
    assert a.shared_prefix > 200 and b.shared_prefix == 0
    assert brm._common(b.prompts[0], b.prompts[1]) < 16  # less than a page in common
    assert [len(r) for r in c.rounds] == [4, 4] and asked == [4]  # one round answered
    for first, second in zip(*c.rounds):  # turn 2 resends turn 1 and its answer (cut at EOS)
        assert second[: len(first)] == first
        assert "Start slowly." in tok.decode(second[len(first) :])


def test_agreement_cut_ratios_and_goals() -> None:
    got, ref = brm._until_eos([[7, 8, 9, 9], [4, 4, 4, 4]], [[7, 8, brm.EOS, 6], [4, 4, 5, 5]])
    assert got == [[7, 8, 9], [4, 4, 4, 4]] and ref == [[7, 8, brm.EOS], [4, 4, 5, 5]]
    rows = [
        {"system": "radixkv float32", "engine": "radixkv", "precision": "float32", "median_s": 2.0},
        {"system": "llama.cpp Q4_1", "engine": "llama.cpp", "precision": "Q4_1", "median_s": 5.0},
        {"system": "llama.cpp f32", "engine": "llama.cpp", "precision": "float32", "median_s": 8.0},
        {"system": "transformers x", "engine": "transformers", "precision": "float32",
         "median_s": 12.0},
    ]  # fmt: skip
    r = brm._ratios(rows)
    assert r["llama.cpp best"] == {"system": "llama.cpp Q4_1", "speedup": 2.5}
    assert r["llama.cpp f32 best"]["speedup"] == 4.0 and r["transformers best"]["speedup"] == 6.0
    goals = brm._goals({"A_shared_prefix": r, "B_unrelated": r})
    assert goals["A_shared_prefix vs llama.cpp best >= 3x"] == {"speedup": 2.5, "met": False}
    assert goals["A_shared_prefix vs transformers best >= 5x"]["met"] is True
    assert goals["B_unrelated vs llama.cpp f32 best >= 1x"]["met"] is True
