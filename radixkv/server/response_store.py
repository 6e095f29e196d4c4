"""The responses a server keeps (``store: true``, the default) for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``: in memory, per tenant, the least recently used
dropped past ``capacity``.

A tenant sees only its own responses: another tenant's id is unknown to it (404), as an id
that never existed or was dropped. A server restart forgets them all (a client continuing an
old conversation gets a 404 and can send the whole conversation as ``input`` instead).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from radixkv.server import protocol as P
from radixkv.server.responses import ResponseObject


@dataclass(frozen=True)
class Stored:
    response: ResponseObject
    # the conversation a continuation starts from (responses.history): its turns and output
    history: list[P.ChatMessage]


class ResponseStore:
    """``(tenant, response id) -> Stored``, at most ``capacity`` entries in all."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, stored: Stored) -> None:
        """Keep ``stored`` (dropping the least recently used past the capacity)."""
        if self.capacity == 0:
            return
        key = (tenant, stored.response.id)
        self._items[key] = stored
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        item = self._items.get((tenant, response_id))
        if item is not None:
            self._items.move_to_end((tenant, response_id))
        return item

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._items.pop((tenant, response_id), None) is not None
