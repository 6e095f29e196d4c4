"""The ``kv_cache_dtype`` names (torch-free): what ``EngineConfig.kv_cache_dtype`` and the
``--kv-cache-dtype`` flags accept, and the torch dtype each one stores pages in (read by
:func:`radixkv.kv.kv_pool.parse_kv_cache_dtype`)."""

from __future__ import annotations

# name -> the torch dtype's attribute (torch.<name>); vLLM's and SGLang's --kv-cache-dtype
# spellings, "fp8" is "fp8_e4m3" as in vLLM
KV_CACHE_DTYPE_ATTRS: dict[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
}
# every kv_cache_dtype name (EngineConfig's and the command line's choices): "auto" is the
# model's dtype
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_ATTRS)
