"""The engine's LoRA adapters by name: loading, unloading, and the cache namespace of each.

A request names an adapter (``Engine.generate(..., lora="sql")``, the server's ``model`` field);
its tokens then run with that adapter's deltas (radixkv/model/lora.py) in the same batches as
everyone else's. Its KV differs from the base model's and from any other adapter's, so its
requests cache under :class:`AdapterNamespace` (the adapter's content digest, and the request's
own namespace): they share cached prefixes with each other, never with another adapter or the
base model. Keyed by content, not by name, so reloading other weights under the same name
never reads stale KV, and the storage tier (shared by a fleet, kept across restarts) serves an
adapter's pages to every engine that loaded the same files.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixkv.model.config import ModelConfig
from radixkv.model.lora import LoRAAdapter, LoRASet, load_lora_adapter

__all__ = ["AdapterNamespace", "LoRAInfo", "LoRARegistry", "parse_lora_modules"]


@dataclass(frozen=True)
class AdapterNamespace:
    """The prefix-cache namespace of requests run with a LoRA adapter (module docstring).

    Its repr is stable across processes (the storage tier and KV events hash it)."""

    adapter: str  # the adapter's content digest (LoRAAdapter.digest)
    namespace: Hashable = None  # the request's own namespace (tenant, cache salt)


@dataclass(frozen=True)
class LoRAInfo:
    """A loaded adapter, as ``Engine.list_loras()`` reports it."""

    name: str
    path: str
    rank: int
    modules: tuple[str, ...]  # the linear layers it adapts (q_proj, ..., down_proj)
    num_parameters: int
    digest: str  # content digest: the cache namespace's key
    slot: int  # its slot in the model runner's LoRASet


def parse_lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """``lora_modules`` as (name, path) pairs: a mapping ``{name: path}``, or ``"name=path"``
    strings (vLLM's ``--lora-modules`` syntax), or pairs. ValueError names a bad entry."""
    if value is None:
        return ()
    items: Iterable[Any] = value.items() if isinstance(value, dict) else value
    if isinstance(value, str | bytes):
        items = [value]
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        elif isinstance(item, tuple | list) and len(item) == 2:
            name, path = item
        else:
            raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        if not isinstance(path, str | Path) or not str(path):
            raise ValueError(f"lora_modules: the path of {name!r} must be a non-empty string")
        pairs.append((check_lora_name(name), str(path)))
    names = [n for n, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"lora_modules: the name {dup!r} is given twice")
    return tuple(pairs)


def check_lora_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(
            f"a LoRA adapter name must be a non-empty string without surrounding spaces, "
            f"got {name!r}"
        )
    return name


class LoRARegistry:
    """Adapters by name over one model's :class:`~radixkv.model.lora.LoRASet`.

    Not thread-safe (the engine's thread owns it). The engine refuses to unload an adapter that
    live requests use; this class only keeps the names."""

    def __init__(self, loras: LoRASet, config: ModelConfig, device: Any, dtype: Any) -> None:
        self._loras = loras
        self._config = config
        self._device = device
        self._dtype = dtype
        self._by_name: dict[str, LoRAInfo] = {}

    def load(self, name: str, path: str | Path) -> LoRAInfo:
        """Read the PEFT adapter folder ``path`` and attach it under ``name``. ValueError when
        the name is taken; ModelLoadError (a ValueError) naming the file and problem when the
        adapter cannot be read or does not fit the model. Nothing changes on an error."""
        return self.attach(self.read(name, path))

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """``load``'s reading half: the adapter, not attached. Changes nothing, so it may run
        in another thread (AsyncEngine reads files off the event loop). Raises as ``load``."""
        check_lora_name(name)
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        return load_lora_adapter(
            path, self._config, name=name, device=self._device, dtype=self._dtype
        )

    def attach(self, adapter: LoRAAdapter) -> LoRAInfo:
        """``load``'s second half: attach an adapter from :meth:`read` under its name
        (ValueError when the name was taken meanwhile)."""
        name = adapter.name
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        slot = self._loras.add(adapter)
        info = LoRAInfo(
            name=name,
            path=adapter.path,
            rank=adapter.rank,
            modules=adapter.modules,
            num_parameters=adapter.num_parameters,
            digest=adapter.digest,
            slot=slot,
        )
        self._by_name[name] = info
        return info

    def unload(self, name: str) -> LoRAInfo:
        info = self.get(name)
        self._loras.remove(info.slot)
        del self._by_name[name]
        return info

    def get(self, name: str) -> LoRAInfo:
        """The adapter called ``name``; ValueError naming the loaded ones otherwise."""
        info = self._by_name.get(name) if isinstance(name, str) else None
        if info is None:
            loaded = ", ".join(repr(n) for n in self._by_name) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return info

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def is_loaded(self, info: LoRAInfo) -> bool:
        """``info`` is the adapter loaded under its name now (not one unloaded since)."""
        return self._by_name.get(info.name) is info

    def of_namespace(self, namespace: Hashable) -> LoRAInfo | None:
        """The loaded adapter whose KV a cache namespace holds (the first loaded of those with
        its content); None for the base model's namespaces or an unloaded adapter's."""
        if not isinstance(namespace, AdapterNamespace):
            return None
        return next((i for i in self._by_name.values() if i.digest == namespace.adapter), None)

    def infos(self) -> list[LoRAInfo]:
        return list(self._by_name.values())

    def namespaces_of(self, info: LoRAInfo, namespaces: Iterable[Hashable]) -> list[Hashable]:
        """The cache namespaces among ``namespaces`` that hold ``info``'s KV (one per request
        namespace it ran under), unless another loaded adapter has the same content."""
        if any(i.digest == info.digest for i in self._by_name.values() if i.name != info.name):
            return []
        return [
            ns
            for ns in namespaces
            if isinstance(ns, AdapterNamespace) and ns.adapter == info.digest
        ]
