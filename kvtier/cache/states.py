"""A node's lifecycle across the tiers: one state machine, its transitions in one table.

A node's state says which tiers hold its bytes and which copy is in flight; nothing else
on a node does (its slots, transfer and page hashes are data that fit the state, and
`kvtier.cache.invariants` checks that they do). Storage holds pages by hash, so "stored"
survives the node leaving the host (a node adopted back onto the device keeps it).

States: `device` (device only), `backing_up` (device; host copy in flight), `both`
(device and host, identical), `host` (host only), `loading` (host; device copy in flight),
each plain or `_stored` (storage holds every page too) or, where the host copy is readable,
`_storing` (a storage write reads it); `host_writing_back` (a write-back eviction waits
for its write); `fetching` (host slots, bytes in flight from storage); `dropped` (out of
the tree). A new node starts `device` (insert) or `fetching` (a prefetch).

Transitions (`TABLE`; `transition` refuses any other with `TransitionError`):

    event          from                   to
    back_up        device                 backing_up
    back_up        device_stored          backing_up_stored
    backed_up      backing_up             both
    backed_up      backing_up_stored      both_stored
    evict_device   both                   host
    evict_device   both_storing           host_storing
    evict_device   both_stored            host_stored
    load           host                   loading
    load           host_storing           loading_storing
    load           host_writing_back      loading_storing
    load           host_stored            loading_stored
    loaded         loading                both
    loaded         loading_storing        both_storing
    loaded         loading_stored         both_stored
    adopt          host                   device
    adopt          host_stored            device_stored
    store          both                   both_storing
    store          host                   host_storing
    write_back     host                   host_writing_back
    stored         both_storing           both_stored
    stored         host_storing           host_stored
    stored         loading_storing        loading_stored
    stored         host_writing_back      host_stored
    store_failed   both_storing           both
    store_failed   host_storing           host
    store_failed   loading_storing        loading
    store_failed   host_writing_back      host
    arrived        fetching               host_stored
    drop           device                 dropped
    drop           device_stored          dropped
    drop           host                   dropped
    drop           host_stored            dropped
    drop           fetching               dropped

Why these and no others: a node is dropped only once nothing reads its slots (a backup
completes first, a write ends first: `*_storing` waits, then drops from `host` or
`host_stored`); a write reads only a readable host copy; a `loading` node's write may end
while it loads; a write-back eviction loaded again forgets the eviction.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from kvtier.errors import TransitionError

__all__ = ["INITIAL", "TABLE", "Event", "NodeState", "TransitionError", "transition"]


class NodeState(str, Enum):
    """Where a node's KV lives, copies in flight included (see the module docstring)."""

    DEVICE = "device"
    DEVICE_STORED = "device_stored"
    BACKING_UP = "backing_up"
    BACKING_UP_STORED = "backing_up_stored"
    BOTH = "both"
    BOTH_STORING = "both_storing"
    BOTH_STORED = "both_stored"
    HOST = "host"
    HOST_STORING = "host_storing"
    HOST_WRITING_BACK = "host_writing_back"
    HOST_STORED = "host_stored"
    LOADING = "loading"
    LOADING_STORING = "loading_storing"
    LOADING_STORED = "loading_stored"
    FETCHING = "fetching"
    DROPPED = "dropped"

    @property
    def on_device(self) -> bool:
        """Device slots hold (or are receiving) its bytes."""
        return self in _ON_DEVICE

    @property
    def on_host(self) -> bool:
        """Host slots are allocated to it (readable unless `fetching` or `backing_up*`)."""
        return self in _ON_HOST

    @property
    def device_only(self) -> bool:
        return self in (NodeState.DEVICE, NodeState.DEVICE_STORED)

    @property
    def host_only(self) -> bool:
        """On the host alone, readable there (what `load_back` loads and the host tier evicts)."""
        return self in _HOST_ONLY

    @property
    def backing_up(self) -> bool:
        return self in (NodeState.BACKING_UP, NodeState.BACKING_UP_STORED)

    @property
    def loading(self) -> bool:
        return self in (NodeState.LOADING, NodeState.LOADING_STORING, NodeState.LOADING_STORED)

    @property
    def both(self) -> bool:
        """On the device and the host, identical."""
        return self in (NodeState.BOTH, NodeState.BOTH_STORING, NodeState.BOTH_STORED)

    @property
    def storing(self) -> bool:
        """A storage write reads its host slots."""
        return self in _STORING

    @property
    def stored(self) -> bool:
        return self.value.endswith("_stored")


S = NodeState
_ON_DEVICE = frozenset(s for s in S if s.value.split("_")[0] in ("device", "backing", "both", "loading"))
_ON_HOST = frozenset(
    s for s in S if s.value.split("_")[0] in ("backing", "both", "host", "loading", "fetching")
)
_HOST_ONLY = frozenset((S.HOST, S.HOST_STORING, S.HOST_WRITING_BACK, S.HOST_STORED))
_STORING = frozenset((S.BOTH_STORING, S.HOST_STORING, S.LOADING_STORING, S.HOST_WRITING_BACK))


class Event(str, Enum):
    """What moves a node (see the module docstring's table)."""

    BACK_UP = "back_up"
    BACKED_UP = "backed_up"
    EVICT_DEVICE = "evict_device"
    LOAD = "load"
    LOADED = "loaded"
    ADOPT = "adopt"
    STORE = "store"
    WRITE_BACK = "write_back"
    STORED = "stored"
    STORE_FAILED = "store_failed"
    ARRIVED = "arrived"
    DROP = "drop"


E = Event
# (event, from) -> to: the module docstring's table, row for row.
TABLE: dict[tuple[Event, NodeState], NodeState] = {
    (E.BACK_UP, S.DEVICE): S.BACKING_UP,
    (E.BACK_UP, S.DEVICE_STORED): S.BACKING_UP_STORED,
    (E.BACKED_UP, S.BACKING_UP): S.BOTH,
    (E.BACKED_UP, S.BACKING_UP_STORED): S.BOTH_STORED,
    (E.EVICT_DEVICE, S.BOTH): S.HOST,
    (E.EVICT_DEVICE, S.BOTH_STORING): S.HOST_STORING,
    (E.EVICT_DEVICE, S.BOTH_STORED): S.HOST_STORED,
    (E.LOAD, S.HOST): S.LOADING,
    (E.LOAD, S.HOST_STORING): S.LOADING_STORING,
    (E.LOAD, S.HOST_WRITING_BACK): S.LOADING_STORING,
    (E.LOAD, S.HOST_STORED): S.LOADING_STORED,
    (E.LOADED, S.LOADING): S.BOTH,
    (E.LOADED, S.LOADING_STORING): S.BOTH_STORING,
    (E.LOADED, S.LOADING_STORED): S.BOTH_STORED,
    (E.ADOPT, S.HOST): S.DEVICE,
    (E.ADOPT, S.HOST_STORED): S.DEVICE_STORED,
    (E.STORE, S.BOTH): S.BOTH_STORING,
    (E.STORE, S.HOST): S.HOST_STORING,
    (E.WRITE_BACK, S.HOST): S.HOST_WRITING_BACK,
    (E.STORED, S.BOTH_STORING): S.BOTH_STORED,
    (E.STORED, S.HOST_STORING): S.HOST_STORED,
    (E.STORED, S.LOADING_STORING): S.LOADING_STORED,
    (E.STORED, S.HOST_WRITING_BACK): S.HOST_STORED,
    (E.STORE_FAILED, S.BOTH_STORING): S.BOTH,
    (E.STORE_FAILED, S.HOST_STORING): S.HOST,
    (E.STORE_FAILED, S.LOADING_STORING): S.LOADING,
    (E.STORE_FAILED, S.HOST_WRITING_BACK): S.HOST,
    (E.ARRIVED, S.FETCHING): S.HOST_STORED,
    (E.DROP, S.DEVICE): S.DROPPED,
    (E.DROP, S.DEVICE_STORED): S.DROPPED,
    (E.DROP, S.HOST): S.DROPPED,
    (E.DROP, S.HOST_STORED): S.DROPPED,
    (E.DROP, S.FETCHING): S.DROPPED,
}
INITIAL = frozenset((S.DEVICE, S.FETCHING))  # a new node's state


def allowed(event: Event, state: NodeState) -> bool:
    return (event, state) in TABLE


class Stateful(Protocol):
    """What has a lifecycle here (a `kvtier.cache.radix.Node`)."""

    state: NodeState


def transition(node: Stateful, event: Event) -> NodeState:
    """Move `node` along `event` (the only way a node's state changes); returns the new state.

    `TransitionError` (nothing changed) where the table has no such row.
    """
    to = TABLE.get((event, node.state))
    if to is None:
        raise TransitionError(f"{node}: no transition {event.value} from {node.state.value}")
    node.state = to
    return to
