"""The attention backends by name (torch-free): the table :func:`radixkv.attention.registry.get_backend`
builds from, ``EngineConfig.attention_backend`` is checked against and ``--attention-backend``
lists.

A backend is a class with :class:`~radixkv.attention.base.AttentionBackend`'s constructor
``(kv_pool, num_qo_heads, num_kv_heads, head_dim, scale, *, layer_windows, softcap)``; adding one
is a module plus a row here (or ``ATTENTION_BACKENDS.register(name, cls)`` from outside). Rows
are ``"module:Class"`` strings, imported only when that backend is built, so reading this table
imports no torch (and flashinfer only when chosen). ``"auto"`` is resolved by
:func:`~radixkv.attention.registry.choose_backend` to one of the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.name_table import NameTable

if TYPE_CHECKING:
    from radixkv.attention.base import AttentionBackend

AUTO = "auto"

ATTENTION_BACKENDS: NameTable[type[AttentionBackend]] = NameTable(
    "attention backend",
    {
        "torch": "radixkv.attention.torch_backend:TorchAttention",
        "flashinfer": "radixkv.attention.flashinfer_backend:FlashInferAttention",
    },
    extra=(AUTO,),
)
