"""bench/bench_server.py runs end to end on a tiny load (it reads the server's /metrics, whose
format it must keep up with) and writes a result with a hit rate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_server_runs_on_a_tiny_load(tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    args = ["--clients", "2", "--requests", "2", "--groups", "1", "--system-tokens", "64"]
    args += ["--max-tokens", "2", "--tenant-tries", "1", "--out", str(out)]
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_server.py"), *args],
        check=True, cwd=ROOT, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    text = json.dumps(result)
    assert "hit_rate" in text
    rows = next(v for v in result.values() if isinstance(v, list))
    on = next(r for r in rows if r["prefix_cache"] == "on")
    assert on["requests"] == 4 and 0.0 < on["hit_rate"] <= 1.0  # the 2nd..4th hit the prompt
