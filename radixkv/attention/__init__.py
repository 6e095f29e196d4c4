"""Attention over paged KV: backend interface, torch and flashinfer backends, registry."""
