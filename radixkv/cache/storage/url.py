"""``open_storage(url)``: a storage backend from the URL a user gives (``--kv-storage URL``).

* ``file:///abs/path`` or a plain path (``/abs/path``, ``./rel``, ``~/x``): FileStorage;
  ``?quota=50GB`` bounds it (least recently used objects go first).
* ``redis://host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock``, and the same with
  ``valkey``/``valkeys`` for a Valkey server: RedisStorage; ``?ttl=SECONDS`` gives each value
  a time to live.

The schemes are the rows of :data:`STORAGE_SCHEMES`: scheme -> opener, a function
``(url, timeout) -> StorageBackend``. A new kind of store is a backend module plus one row
(``STORAGE_SCHEMES.register("s3", open_s3)``, or a ``"module:function"`` string imported when
first used). A URL without a scheme is a path.

A bad URL is a ValueError naming the problem (an unknown scheme: the known ones), raised before
anything is connected or created; a missing client library an ImportError saying what to install.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from radixkv.cache.storage.backend import StorageBackend
from radixkv.cache.storage.file_backend import FileStorage
from radixkv.cache.storage.redis_backend import RedisStorage
from radixkv.name_table import NameTable
from radixkv.units import parse_bytes

__all__ = ["STORAGE_SCHEMES", "StorageOpener", "open_storage", "url_options"]

# An opener: (the URL as given, stripped; seconds a call to the store may take) -> the backend.
# It raises ValueError naming the URL's problem before connecting or creating anything.
StorageOpener = Callable[[str, float], StorageBackend]


def url_options(query: str, allowed: set[str], url: str) -> dict[str, str]:
    """The ``?name=value`` options of ``url`` (its ``query``); ValueError naming any that are
    not ``allowed``."""
    opts = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(opts) - allowed
    if unknown:
        raise ValueError(
            f"storage URL {url!r}: unknown option(s) {sorted(unknown)} (allowed: {sorted(allowed)})"
        )
    return opts


def _file_storage(url: str, path: str, opts: dict[str, str]) -> FileStorage:
    if not path:
        raise ValueError(f"storage URL {url!r} names no directory")
    quota = None
    if "quota" in opts:
        try:
            quota = parse_bytes(opts["quota"])
        except ValueError as e:
            raise ValueError(f"storage URL {url!r}: quota: {e}") from None
    return FileStorage(path, quota_bytes=quota)


def open_file(url: str, timeout: float) -> FileStorage:
    """``file:///abs/path?quota=50GB``: a directory (a local path only)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"storage URL {url!r}: a file URL names a local path (file:///…)")
    return _file_storage(url, unquote(parts.path), url_options(parts.query, {"quota"}, url))


# our scheme -> the one redis-py reads
_REDIS = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


def open_redis(url: str, timeout: float) -> RedisStorage:
    """``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, ``unix://``: a Redis or Valkey
    server; ``?ttl=SECONDS`` (ours), ``db``, ``password``, ``username`` (redis-py's)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    opts = url_options(parts.query, {"ttl", "db", "password", "username"}, url)
    ttl = None
    if "ttl" in opts:
        try:
            ttl = int(opts.pop("ttl"))
        except ValueError:
            raise ValueError(f"storage URL {url!r}: ttl must be whole seconds") from None
    real = urlunsplit((_REDIS.get(scheme, scheme), parts.netloc, parts.path, urlencode(opts), ""))
    return RedisStorage(real, ttl=ttl, timeout=timeout)


STORAGE_SCHEMES: NameTable[StorageOpener] = NameTable(
    "scheme",
    {
        "file": open_file,
        "redis": open_redis,
        "rediss": open_redis,
        "valkey": open_redis,
        "valkeys": open_redis,
        "unix": open_redis,
    },
)


def open_storage(url: str, *, timeout: float = 1.0) -> StorageBackend:
    """The backend ``url`` names (see the module docstring); ``timeout``: seconds a call to the
    store (a Redis call) may take."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a storage URL must be a non-empty string, got {url!r}")
    url = url.strip()
    scheme = urlsplit(url).scheme.lower()
    if not scheme:  # a plain path, taken as it is (no options)
        return _file_storage(url, url, {})
    try:
        opener = STORAGE_SCHEMES.get(scheme)
    except ValueError as e:
        raise ValueError(f"storage URL {url!r}: {e}, or a plain path") from None
    return opener(url, timeout)
