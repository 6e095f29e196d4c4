"""bench/bench_fairness.py runs end to end on a tiny flood (it reads the server's per-tenant
load, whose shape it must keep up with) and writes both sides' rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_fairness_runs_on_a_tiny_flood(tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    args = ["--flood-prompts", "6", "--flood-requests", "1", "--flood-batch", "2"]
    args += ["--flood-tokens", "6", "--other-requests", "2", "--other-tokens", "2"]
    args += ["--max-running", "2", "--num-pages", "512", "--repeats", "1", "--out", str(out)]
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_fairness.py"), *args],
        check=True, cwd=ROOT, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [r["fair_admission"] for r in result["summary"]] == ["off", "on"]
    for row in result["summary"]:
        assert row["runs"] == 1 and row["other_ttft_max_ms"] > 0
        assert row["flood_last_done_s"] >= row["flood_first_done_s"] > 0
