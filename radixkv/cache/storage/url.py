"""``open_storage(url)``: a storage backend from the URL a user gives (``--kv-storage URL``).

* ``file:///abs/path`` or a plain path (``/abs/path``, ``./rel``, ``~/x``): FileStorage;
  ``?quota=50GB`` bounds it (least recently used objects go first).
* ``redis://host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock``, and the same with
  ``valkey``/``valkeys`` for a Valkey server: RedisStorage; ``?ttl=SECONDS`` gives each value
  a time to live.

A bad URL is a ValueError naming the problem, raised before anything is connected or created;
a missing client library an ImportError saying what to install.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from radixkv.cache.storage.backend import StorageBackend
from radixkv.cache.storage.file_backend import FileStorage
from radixkv.cache.storage.redis_backend import RedisStorage
from radixkv.units import parse_bytes

__all__ = ["open_storage"]

_REDIS = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


def _options(query: str, allowed: set[str], url: str) -> dict[str, str]:
    opts = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(opts) - allowed
    if unknown:
        raise ValueError(
            f"storage URL {url!r}: unknown option(s) {sorted(unknown)} (allowed: {sorted(allowed)})"
        )
    return opts


def open_storage(url: str, *, timeout: float = 1.0) -> StorageBackend:
    """The backend ``url`` names (see the module docstring); ``timeout``: seconds a Redis call
    may take."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a storage URL must be a non-empty string, got {url!r}")
    url = url.strip()
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file"):
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"storage URL {url!r}: a file URL names a local path (file:///…)")
            path = unquote(parts.path)
            opts = _options(parts.query, {"quota"}, url)
        else:
            path, opts = url, {}
        if not path:
            raise ValueError(f"storage URL {url!r} names no directory")
        quota = None
        if "quota" in opts:
            try:
                quota = parse_bytes(opts["quota"])
            except ValueError as e:
                raise ValueError(f"storage URL {url!r}: quota: {e}") from None
        return FileStorage(path, quota_bytes=quota)
    if scheme in _REDIS or scheme == "unix":
        opts = _options(parts.query, {"ttl", "db", "password", "username"}, url)
        ttl = None
        if "ttl" in opts:
            try:
                ttl = int(opts.pop("ttl"))
            except ValueError:
                raise ValueError(f"storage URL {url!r}: ttl must be whole seconds") from None
        real = urlunsplit(
            (_REDIS.get(scheme, scheme), parts.netloc, parts.path, urlencode(opts), "")
        )
        return RedisStorage(real, ttl=ttl, timeout=timeout)
    raise ValueError(
        f"storage URL {url!r}: unknown scheme {parts.scheme!r} (use file:///path, a path, "
        "redis://host:port/db or valkey://host:port/db)"
    )
