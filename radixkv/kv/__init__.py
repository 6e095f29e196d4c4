"""K/V storage: :class:`radixkv.kv.kv_pool.KVPool` (per-layer paged K and V tensors)."""
