"""The storage secret: the per-deployment key of the page objects' MAC (page_format.py).

Whoever can write the storage (the directory, the Redis database) could otherwise put any KV
under any key and have it served to any tenant; with the MAC they can only delete or damage
objects, which readers see as misses. The secret comes from, first found:

1. the environment variable ``RADIXKV_STORAGE_SECRET`` (at least 32 hex digits: 16 bytes);
2. the file ``path`` (the engine's ``kv_storage_secret_file``), by default
   ``$XDG_CONFIG_HOME/radixkv/storage_secret`` (``~/.config/...``): its first line, hex.
   Absent, it is created with 32 random bytes, mode 0600 (created exclusively: two processes
   starting at once end up with the same secret).

Every engine that shares a store must share the secret (the same file or variable), or each
treats the others' objects as forged. The secret is never logged; errors name the file only.
See docs/security.md, "The storage tier".
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["ENV_SECRET", "default_secret_path", "load_storage_secret"]

ENV_SECRET = "RADIXKV_STORAGE_SECRET"
_MIN_BYTES = 16
_NEW_BYTES = 32


def default_secret_path() -> Path:
    """Where the secret file is by default (not in the storage: its writers must not read it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "radixkv" / "storage_secret"


def _parse(text: str, where: str) -> bytes:
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"the storage secret in {where} is not hex digits") from None
    if len(key) < _MIN_BYTES:
        raise ValueError(
            f"the storage secret in {where} is {len(key)} bytes; at least {_MIN_BYTES} "
            f"({2 * _MIN_BYTES} hex digits) are needed"
        )
    return key


def load_storage_secret(path: str | os.PathLike[str] | None = None) -> bytes:
    """The storage secret (see the module docstring): from ``RADIXKV_STORAGE_SECRET``, else
    read from ``path`` (None: ``default_secret_path()``), created there if absent. Raises
    ValueError naming the source when it is malformed, OSError when the file cannot be read
    or created."""
    env = os.environ.get(ENV_SECRET)
    if env is not None:
        return _parse(env, f"${ENV_SECRET}")
    p = Path(path).expanduser() if path is not None else default_secret_path()
    try:
        return _parse(p.read_text(encoding="ascii"), str(p))
    except FileNotFoundError:
        pass
    except UnicodeDecodeError:
        raise ValueError(f"the storage secret in {p} is not hex digits") from None
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    new = secrets.token_bytes(_NEW_BYTES)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (new.hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)  # exclusive: if another process made one first, theirs is used
    except FileExistsError:
        return _parse(p.read_text(encoding="ascii"), str(p))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return new
