"""The README's ``radixkv serve-ray`` example, run as a user runs it, on this machine's CPUs.

The README's command line (its model placeholder filled with radixkv-tiny, a free loopback port
added) runs in a subprocess with its own Ray temp folder. The test waits for the ready line,
sends a completion, stops the server with SIGTERM, and checks that it exits 0 and that every
process it started (Ray's GCS, raylet, workers, replicas) is gone. The command also gets an API
key file and ``--strict-api``, to check on the real fleet what the flags promise: keys checked
by the replicas, the file re-read on change without a restart, unknown fields refused. On a 2-core machine the
command used to wait forever: 4 replicas x 1 CPU + 0.1 for the ingress could never be
scheduled. One Ray start (the slow part), so one test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixkv.cluster.placement import plan_cpus

ROOT = Path(__file__).resolve().parents[1]
READY = "OpenAI API at http://"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]


def _readme_command() -> list[str]:
    """The README's serve-ray line, as argv."""
    lines = [
        ln.split("#")[0].strip()
        for ln in (ROOT / "README.md").read_text().splitlines()
        if ln.startswith("radixkv serve-ray ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].replace("PATH_OR_NAME", "radixkv-tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_table() -> dict[tuple[int, int], int]:
    """(pid, start time) -> parent pid, for every process now running (Linux /proc; zombies,
    which have exited and wait only to be reaped, do not count)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] == "Z":
            continue
        out[(int(d.name), int(fields[19]))] = int(fields[1])  # starttime, ppid
    return out


def _descendants(pid: int) -> set[tuple[int, int]]:
    """(pid, start time) of every live descendant of ``pid`` (the start time tells a reused
    pid apart)."""
    table = _proc_table()
    children: dict[int, list[tuple[int, int]]] = {}
    for key, ppid in table.items():
        children.setdefault(ppid, []).append(key)
    found: set[tuple[int, int]] = set()
    todo = [pid]
    while todo:
        for key in children.get(todo.pop(), []):
            if key not in found:
                found.add(key)
                todo.append(key[0])
    return found


def _alive(procs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return procs & set(_proc_table())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_readme_serve_ray_example_serves_and_stops_cleanly() -> None:
    argv = _readme_command()
    assert argv[:2] == ["radixkv", "serve-ray"] and "--replicas" in argv
    port = _free_port()
    # short: Ray's socket paths under it must stay within the 107-character limit
    ray_tmp = tempfile.mkdtemp(prefix="rkv", dir="/tmp")
    keys = Path(ray_tmp) / "keys.json"
    keys.write_text(json.dumps({"key-alice-1": "alice"}))
    script = Path(sys.executable).with_name("radixkv")
    cmd = [str(script) if script.exists() else "radixkv", *argv[1:], "--port", str(port)]
    cmd += ["--api-keys", str(keys), "--strict-api"]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        RAY_TMPDIR=ray_tmp,
        OMP_NUM_THREADS="1",  # replicas share 2 cores: one OpenMP thread each
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    started: set[tuple[int, int]] = set()
    t0 = time.monotonic()
    try:
        while not any(READY in ln for ln in lines) and proc.poll() is None:
            assert time.monotonic() - t0 < 240, "".join(lines)
            started |= _descendants(proc.pid)
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        out = "".join(lines)
        assert proc.poll() is None, out  # serving, not exited
        # it said how it fitted the replicas to this machine's CPUs
        from ray._private.utils import get_num_cpus

        replicas = int(argv[argv.index("--replicas") + 1])
        plan = plan_cpus(replicas=replicas, available_cpus=float(get_num_cpus()))
        assert f"radixkv serve-ray: {plan.describe()}" in out, out
        url = re.search(r"OpenAI API at (\S+)", out).group(1)  # type: ignore[union-attr]
        assert url == f"http://127.0.0.1:{port}/v1"
        req = {"model": "radixkv-tiny", "prompt": "Hello", "max_tokens": 8}

        def post(key: str | None, body: dict[str, object]) -> httpx.Response:
            auth = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{url}/completions", json=body, headers=auth, timeout=60)

        assert post(None, req).status_code == 401
        assert post("key-alice-1", {**req, "not_a_field": 1}).status_code == 400  # --strict-api
        r = post("key-alice-1", req)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        assert "radixkv#RadixKVReplica#" in r.headers["x-radixkv-replica"]  # a fleet answered
        # the key file changes: every replica follows it, no restart (requests spread over them)
        keys.write_text(json.dumps({"key-bob-12345": "bob"}))
        assert {post("key-alice-1", req).status_code for _ in range(6)} == {401}
        assert {post("key-bob-12345", req).status_code for _ in range(6)} == {200}
        started |= _descendants(proc.pid)
        assert len(started) >= 4, started  # Ray's processes were seen (else the check is void)

        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(lines)
        stop_s = time.monotonic() - t1
        deadline = time.monotonic() + 20  # the raylet reaps its workers asynchronously
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not _alive(started), f"left behind: {sorted(_alive(started))}"
        print(f"\n[serve-ray] ready in {ready_s:.0f} s, stopped in {stop_s:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, _ in _alive(started):  # only what this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reader.join(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
        shutil.rmtree(ray_tmp, ignore_errors=True)
