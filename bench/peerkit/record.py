"""Where a benchmark's files go and what its result file says about the run: the machine, the
date, the versions; writing the JSON that bench/make_report.py renders."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the source checkout
RESULTS_DIR = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "peers"  # checkpoints, adapters and GGUF files, reused


def results_path(stem: str) -> Path:
    """bench/results/<stem>.json: where make_report.py looks for a benchmark's results."""
    return RESULTS_DIR / f"{stem}.json"


def utc_now(at: float | None = None) -> str:
    """``YYYY-MM-DD HH:MM UTC`` (now, or at the ``time.time()`` value ``at``)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


def cpu_name() -> str:
    """The CPU's model name (for the result files' machine line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    """The 1-minute load average: other jobs on a shared machine slow every timing."""
    return os.getloadavg()[0]


def machine_line(load: float | None = None) -> str:
    """``<CPU>, <n> CPUs, load average at start <load>`` (``load``: taken at the start; now
    when not given)."""
    load = load_average() if load is None else load
    return f"{cpu_name()}, {os.cpu_count()} CPUs, load average at start {load:.1f}"


def machine_dict() -> dict[str, Any]:
    """``{"platform": ..., "cpus": ...}``, the machine of the small peer scripts' files."""
    return {"platform": platform.platform(), "cpus": os.cpu_count()}


def versions(*packages: str) -> dict[str, str]:
    """Python's version and each installed package's (missing ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def write_json(path: Path | str, data: Any) -> Path:
    """``data`` as indented JSON at ``path`` (folders made; anything JSON lacks as its text),
    and a line saying so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def print_rows(rows: list[dict[str, Any]]) -> None:
    """Each summary row on a line, as the peer scripts print them."""
    for row in rows:
        print(row)


def pip_download(dest: Path, *requirement: str) -> None:
    """``pip download --no-deps`` of ``requirement`` (a spec, with any other pip flags) into
    ``dest``: a peer's files fetched without installing it or its dependencies."""
    import subprocess
    import sys

    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *requirement],
        check=True,
    )
