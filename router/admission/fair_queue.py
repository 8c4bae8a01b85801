"""A priority class's queue in the router (router/admission/gate.py): weighted fair across tenants, FIFO within each.

Weighted fair queueing by virtual time: a request's finish tag is its start (the later of the queue's virtual time and
its tenant's previous finish tag) plus its prompt tokens over its tenant's weight; the lowest finish tag leaves first,
and the queue's virtual time becomes its start. A tenant that queues much gets tags far ahead and is served at its
share, not before the others; one that queues little, or comes back after a pause, starts at the virtual time: it
neither waits behind another's backlog nor saves up a burst.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self.by_tenant: dict[str, deque[tuple[float, float, T]]] = {}  # (start, finish, item), FIFO per tenant
        self.finished: dict[str, float] = {}  # each tenant's last finish tag
        self.virtual_time = 0.0

    def append(self, tenant: str, weight: float, tokens: int, item: T) -> None:
        start = max(self.virtual_time, self.finished.get(tenant, 0.0))
        finish = self.finished[tenant] = start + max(1, tokens) / weight
        self.by_tenant.setdefault(tenant, deque()).append((start, finish, item))

    def _next(self) -> str | None:
        return min(self.by_tenant, key=lambda tenant: self.by_tenant[tenant][0][1], default=None)

    def head(self) -> T | None:
        tenant = self._next()
        return None if tenant is None else self.by_tenant[tenant][0][2]

    def popleft(self) -> T:
        tenant = self._next()
        if tenant is None:
            raise IndexError("pop from an empty FairQueue")
        queue = self.by_tenant[tenant]
        start, _, item = queue.popleft()
        if not queue:
            del self.by_tenant[tenant]
        self.virtual_time = max(self.virtual_time, start)
        return item

    def remove(self, item: T) -> bool:
        """Take `item` out (it left: timed out, or its client went); False if it was not queued."""
        for tenant, queue in self.by_tenant.items():
            for entry in queue:
                if entry[2] is item:
                    queue.remove(entry)
                    if not queue:
                        del self.by_tenant[tenant]
                    return True
        return False

    def __iter__(self) -> Iterator[T]:
        return (entry[2] for queue in self.by_tenant.values() for entry in queue)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.by_tenant.values())

    def __bool__(self) -> bool:
        return bool(self.by_tenant)
