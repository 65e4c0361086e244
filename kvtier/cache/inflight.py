"""The device <-> host transfers in flight: which nodes each one moves, in submission order.

`InFlight` keeps, per transfer, its nodes (a split adds the new head to its transfer) and
its `LoadHandle` (loads only), and per direction the submission order. A mover completes a
lane's operations in order, so `done()` scans each direction from its oldest transfer and
stops at the first unfinished one: O(completed), however many are in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvtier.cache.handles import LoadHandle
from kvtier.cache.movers import Transfer
from kvtier.cache.radix import Node
from kvtier.pool.device import Direction

Record = tuple[Transfer, list[Node], LoadHandle | None]


class InFlight:
    """Transfers submitted and not yet completed (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[int, Record] = {}
        self._order: dict[Direction, deque[Transfer]] = {d: deque() for d in Direction}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, transfer: Transfer | None) -> bool:
        return transfer is not None and id(transfer) in self._records

    def track(self, transfer: Transfer, nodes: list[Node], handle: LoadHandle | None, d: Direction) -> None:
        self._records[id(transfer)] = (transfer, nodes, handle)
        self._order[d].append(transfer)

    def add_node(self, transfer: Transfer, node: Node) -> None:
        """`node` (a split's head) is moved by `transfer` too."""
        self._records[id(transfer)][1].append(node)

    def pop(self, transfer: Transfer) -> Record:
        return self._records.pop(id(transfer))

    def done(self) -> Iterator[Transfer]:
        """Tracked transfers whose signal has fired, oldest first per direction (no waiting)."""
        for queue in self._order.values():
            while queue:
                transfer = queue[0]
                if id(transfer) in self._records:
                    if not transfer.done():
                        break
                    yield transfer
                queue.popleft()

    def records(self) -> list[Record]:
        return list(self._records.values())
