"""bench/peerkit/, what the bench scripts share: rotated rounds, output comparison, result files,
and its lazy names (a torch-free benchmark stays torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import peerkit  # noqa: E402


def test_rounds_rotate_the_order_and_keep_each_output(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def system(name: str) -> object:
        def run() -> str:
            calls.append(name)
            return f"{name}{len(calls)}"

        return run

    systems = {n: system(n) for n in ("a", "b", "c")}
    times, outputs = peerkit.rotated_rounds_all(systems, 3, label="w ")
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert outputs == {"a": ["a1", "a6", "a8"], "b": ["b2", "b4", "b9"], "c": ["c3", "c5", "c7"]}
    assert all(len(ts) == 3 and min(ts) >= 0 for ts in times.values())
    assert "w round 1: b: " in capsys.readouterr().out
    _, last = peerkit.rotated_rounds(systems, 2)
    assert last == {"a": "a15", "b": "b13", "c": "c14"}  # round 1 runs b, c, a
    assert peerkit.medians({"x": [3.0, 1.0, 2.0]}) == {"x": 2.0}


def test_outputs_compared_token_by_token() -> None:
    got = [[1, 2, 3], [1, 9, 9], [4]]
    ref = [[1, 2, 3], [1, 2, 3], [5]]
    a = peerkit.agreement(got, ref)
    assert a["identical"] == "1/3" and a["identical_frac"] == pytest.approx(1 / 3)
    assert a["mean_agreeing_prefix"] == pytest.approx((3 + 1 + 0) / 3)
    assert peerkit.identical(got, ref) == "1/3" and peerkit.same_count(got, ref) == 1


def test_results_are_written_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = peerkit.write_json(tmp_path / "deep" / "r.json", {"p": tmp_path, "n": 1})
    assert json.loads(path.read_text()) == {"p": str(tmp_path), "n": 1}
    assert capsys.readouterr().out == f"wrote {path}\n"
    assert peerkit.results_path("bench_x") == peerkit.ROOT / "bench" / "results" / "bench_x.json"
    assert peerkit.utc_now(0) == "1970-01-01 00:00 UTC"


def test_names_resolve_lazily_and_the_record_needs_no_torch() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import peerkit; "
        "peerkit.write_json; peerkit.rotated_rounds; peerkit.agreement; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert sys.path[0] == str(peerkit.ROOT)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = peerkit.nothing


def test_bench_peers_still_exports_its_helpers() -> None:
    """Other scripts (a real-model benchmark among them) import the helpers from bench_peers."""
    import bench_peers

    for name in bench_peers.__all__:
        assert getattr(bench_peers, name) is not None, name
    assert bench_peers.rotated_rounds is peerkit.rotated_rounds
    assert bench_peers.transformers_systems is peerkit.transformers_systems
    assert peerkit.results_path("bench_peers") == bench_peers.RESULTS
