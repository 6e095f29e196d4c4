"""bench/bench_cache.py runs (smoke, --quick) and its exact outputs are right; no timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cache_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_cache
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = tmp_path / "bench_cache.json"
    assert bench_cache.main(["--quick", "--repeat", "1", "--out", str(out)]) == 0
    assert "match mean/p99" in capsys.readouterr().out
    data = json.loads(out.read_text())
    ideal = data["workload"]["ideal_hit_rate"]
    assert data["results"].keys() == {"ps1_array", "ps16_array", "ps16_list", "ps64_array"}
    for r in data["results"].values():
        assert r["hit_rate"] == pytest.approx(ideal)  # exact: no eviction during the replay
        assert r["evicted_pages"] == r["cached_pages"] // 2
        assert r["match_us"]["n"] == data["workload"]["requests"]
    assert data["results"]["ps16_array"]["metadata"]["bytes_per_token"] > 8  # keys alone: 8
    assert len(data["summary"]) == 4
