"""The one validator of slot ids that callers hand to kvtier (allocators, plans, the cache).

Every public entry point that takes slot ids turns them into a `[n]` int64 array here,
so a wrong dtype, shape, device or an id out of range is refused with one kind of
message (`SlotError`) before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import SlotError

_MAX_LISTED = 10

SlotIds = torch.Tensor | np.ndarray | Sequence[int]


def fmt_ids(ids: np.ndarray) -> str:
    """Up to ten ids, then a count, for error messages."""
    shown = ", ".join(str(int(i)) for i in ids[:_MAX_LISTED])
    more = f", ... ({len(ids)} in all)" if len(ids) > _MAX_LISTED else ""
    return f"[{shown}{more}]"


def as_slots(name: str, slots: SlotIds, limit: int | None = None, *, distinct: bool = False) -> np.ndarray:
    """`slots` as a `[n]` int64 numpy array (sharing memory where it can).

    `slots`: a 1-D integer CPU tensor, numpy array or sequence of ints. `limit`: every id
    must be in `[0, limit)`; `distinct`: no id may repeat. Raises `SlotError` naming
    `name` and the offending ids otherwise.
    """
    if isinstance(slots, torch.Tensor):
        dt = slots.dtype
        if slots.device.type != "cpu":
            raise SlotError(f"{name} must be on the CPU, got {slots.device}")
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise SlotError(f"{name} must be integer ids, got dtype {dt}")
        if slots.dim() != 1:
            raise SlotError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
        arr = slots.detach().numpy()
    else:
        try:
            arr = np.asarray(slots)
        except (TypeError, ValueError) as e:
            raise SlotError(f"{name} must be a sequence of ints: {e}") from None
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise SlotError(f"{name} must be integer ids, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise SlotError(f"{name} must be 1-D, got shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if limit is not None and len(arr):
        bad = arr[(arr < 0) | (arr >= limit)]
        if len(bad):
            raise SlotError(f"{name} has ids outside [0, {limit}): {fmt_ids(bad)}")
    if distinct and len(arr) > 1:
        s = np.sort(arr)
        dup = np.unique(s[1:][s[1:] == s[:-1]])
        if len(dup):
            raise SlotError(f"{name} repeats ids {fmt_ids(dup)}")
    return arr


def as_slot_tensor(
    name: str, slots: SlotIds, limit: int | None = None, *, distinct: bool = False
) -> torch.Tensor:
    """`as_slots` as a `[n]` int64 CPU tensor."""
    return torch.from_numpy(np.ascontiguousarray(as_slots(name, slots, limit, distinct=distinct)))


NO_SLOTS = torch.empty(0, dtype=torch.int64)  # shared: a tensor of no elements holds nothing to write


def concat_slots(parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`[n]` int64 CPU slots of several parts in order, without a copy for one part (joined by
    numpy, which joins one long tensor much faster than `torch.cat`)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return NO_SLOTS
    return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
