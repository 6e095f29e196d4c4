"""RedisStorage: objects as binary string values in a Redis or Valkey server (redis-py).

The optional extra ``radixkv[redis]`` installs the client; the server is yours. Keys are
``radixkv:kv:<key>``; a value is written with ``SET`` (``EX ttl`` when a TTL is given), read
with ``MGET`` in batches. Every engine of a fleet points at the same server and database, so a
prefix computed by one replica is found by the others. Size the server with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (or give a TTL) so it evicts old pages instead of refusing
writes; a refused write is a storage error ("full"), counted and dropped.

Timeouts are short on purpose (``timeout`` seconds to connect and per call): a slow or dead
server must cost a request a miss, never a stalled engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from radixkv.cache.storage.backend import StorageBackend, StorageError

__all__ = ["RedisStorage"]

KEY_PREFIX = "radixkv:kv:"
_BATCH = 32  # keys per MGET / pipeline: bounded replies when pages are megabytes each


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError(
            "a redis:// KV storage needs the redis client: pip install 'radixkv[redis]'"
        ) from None
    return redis


def _safe_url(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class RedisStorage(StorageBackend):
    """Objects in a Redis/Valkey server.

    Args:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS, ``unix://`` for a
            socket); nothing is connected until the first call.
        ttl: seconds each value lives (None: until the server evicts it).
        timeout: seconds to connect and to wait for each reply.
    """

    def __init__(self, url: str, *, ttl: int | None = None, timeout: float = 1.0) -> None:
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"ttl must be a positive int of seconds or None, got {ttl!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        redis = _import_redis()
        self._errors = redis.exceptions
        self.url = _safe_url(url)
        self.ttl = ttl
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError as e:
            raise ValueError(f"bad redis storage URL {self.url!r}: {e}") from None

    def _fail(self, e: Exception, what: str) -> StorageError:
        ex = self._errors
        if isinstance(e, ex.TimeoutError):
            return StorageError("timeout", f"{what} on {self.url}: timed out ({e})")
        if isinstance(e, ex.ConnectionError):
            return StorageError("unreachable", f"{what} on {self.url}: cannot connect ({e})")
        if isinstance(e, getattr(ex, "OutOfMemoryError", ())) or (
            isinstance(e, ex.ResponseError) and str(e).startswith("OOM")
        ):
            return StorageError("full", f"{what} on {self.url}: server memory full ({e})")
        if isinstance(e, ex.AuthenticationError | ex.NoPermissionError):
            return StorageError("permission", f"{what} on {self.url}: not allowed ({e})")
        return StorageError("io", f"{what} on {self.url}: {e}")

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        try:
            for i in range(0, len(keys), _BATCH):
                out += self._client.mget([KEY_PREFIX + k for k in keys[i : i + _BATCH]])
        except self._errors.RedisError as e:
            raise self._fail(e, "MGET") from e
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        try:
            for i in range(0, len(items), _BATCH):
                pipe = self._client.pipeline(transaction=False)
                for key, value in items[i : i + _BATCH]:
                    pipe.set(KEY_PREFIX + key, value, ex=self.ttl)
                pipe.execute()
        except self._errors.RedisError as e:
            raise self._fail(e, "SET") from e

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            self._client.delete(*[KEY_PREFIX + k for k in keys])
        except self._errors.RedisError as e:
            raise self._fail(e, "DEL") from e

    def close(self) -> None:
        self._client.close()
