"""What `insert` changes in the tree: its checks before anything changes, and the slots it adopts.

`check_insert` reads the tree and the device tier only and raises `SlotError` for a bad call; the
manager changes nothing before it returns. `take_slots` walks the path the tree already
holds: where a node is on the device the caller's duplicate slots go back (the tree's stay),
where a node is host-only it takes the caller's fresh slots and drops its host copy.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.cache.moves import NodeMoves
from kvtier.cache.radix import Node, RadixTree
from kvtier.cache.states import Event, transition
from kvtier.cache.tiers import DeviceTier
from kvtier.errors import SlotError
from kvtier.slots import as_slots, fmt_ids


def check_insert(
    tree: RadixTree, device: DeviceTier, key: np.ndarray, device_slots: torch.Tensor
) -> np.ndarray:
    """`insert`'s checks of `key` (`[n]` token ids) and `device_slots`: the slots as `[n]` int64."""
    ps = tree.page_size
    if len(key) % ps:
        raise SlotError(f"insert: {len(key)} tokens is not a whole number of pages of {ps}")
    s = as_slots("device_slots", device_slots, device.num_slots, distinct=True)
    if len(s) != len(key):
        raise SlotError(f"insert: {len(key)} tokens but {len(s)} device slots")
    nodes, pos, partial, shared = tree.walk(key)
    tree_slots = np.full(len(key), -1, dtype=np.int64)
    at = 0
    for n in [*nodes, *([partial] if partial is not None else [])]:
        length = len(n) if n is not partial else shared
        if n.state.on_device:
            tree_slots[at : at + length] = n.device_slots[:length].numpy()
        at += length
    covered = pos + shared
    own = tree_slots[:covered] == s[:covered]
    must_hold = np.concatenate([s[:covered][~own], s[covered:]])
    held = device.held_mask(must_hold)
    if not held.all():
        bad = must_hold[~held]
        raise SlotError(f"insert: device slots {fmt_ids(bad)} are not held by the caller")
    return s


def take_slots(moves: NodeMoves, nodes: list[Node], s: np.ndarray) -> list[Node]:
    """Along `nodes` (the path `s`, `[n]` int64, covers first): free the caller's duplicates of
    device slots, adopt them for host-only nodes; returns the adopted nodes."""
    device = moves.device
    adopted: list[Node] = []
    at = 0
    for n in nodes:
        mine = s[at : at + len(n)]
        at += len(n)
        if n.state.on_device:
            if not (n.device_slots.numpy() == mine).all():
                device.free(mine)
                device.unhold(mine)
            continue
        moves.free_host(n)  # host only: take the caller's fresh KV, drop the host copy
        transition(n, Event.ADOPT)
        n.device_slots = torch.from_numpy(mine.copy())
        moves.place(n)
        device.unhold(mine)
        adopted.append(n)
    return adopted
