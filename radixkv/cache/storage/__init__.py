"""The storage tier's torch-free part: backends (a directory, Redis/Valkey), the URL that picks
one, and the page objects and keys (content-addressed by chained page hash, namespace and KV
format; MAC'd with a per-deployment secret and checked on every read). The engine side (radixkv/engine/storage_tier.py) prefetches
pages into the host tier and writes host pages out."""

from radixkv.cache.storage.backend import StorageBackend, StorageError
from radixkv.cache.storage.file_backend import FileStorage
from radixkv.cache.storage.page_format import kv_format_id, page_keys, prefix_digests
from radixkv.cache.storage.page_store import KnownKeys, PageStore
from radixkv.cache.storage.redis_backend import RedisStorage
from radixkv.cache.storage.secret import load_storage_secret
from radixkv.cache.storage.url import open_storage

__all__ = [
    "FileStorage",
    "KnownKeys",
    "PageStore",
    "RedisStorage",
    "StorageBackend",
    "StorageError",
    "kv_format_id",
    "load_storage_secret",
    "open_storage",
    "page_keys",
    "prefix_digests",
]
