"""Slot allocation for a KV pool: which slots are free, handed out and taken back a page at a time.

`HostSlotAllocator` owns the mapping "which slots are free" for one pool of `num_slots`
slots in pages of `page_size`; it never touches the KV bytes.

Invariants (both policies):

* Work happens in whole pages: `alloc(n)` needs a positive multiple of `page_size`, and
  each page it hands out contributes its slots `page * page_size + 0 .. page_size - 1`.
* Every page is in one of three states (numpy `int8`): 0 never allocated, 1 allocated,
  2 free again. A page is in the free structure iff its state is not 1.
* `alloc(n)` returns `None` exactly when `available() < n`; both policies succeed and
  fail on the same calls and differ only in which ids they return.
* Every error is raised before anything changes; ids handed to `free` go through
  `kvtier.slots.as_slots`.
* A call costs what the ids and free runs it touches cost, never the pool size (except
  `free_runs` / `largest_free_run` under "first_fit").

Policies: "first_fit" is the stock allocator, a FIFO free list (pages in order at first;
alloc takes from the head, free appends in the order given, so churn scrambles it).
"contiguous" (default) keeps free pages as merged maximal runs and returns one ascending
run whenever one fits (best fit), else the largest runs first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import Enum

import numpy as np
import torch
from sortedcontainers import SortedList

from kvtier.errors import AllocatorCorruptError, InvariantError, SlotError
from kvtier.slots import as_slots, fmt_ids

# Page states (see the module docstring).
_NEVER = 0
_LIVE = 1
_FREED = 2


class AllocPolicy(str, Enum):
    """How `HostSlotAllocator` chooses which free pages to hand out."""

    CONTIGUOUS = "contiguous"
    FIRST_FIT = "first_fit"


class HostSlotAllocator:
    """Hands out and takes back slot ids of a pool, a whole page at a time.

    `num_slots`: a positive multiple of `page_size`; `policy`: an `AllocPolicy` or its value.
    Read-only attributes: `num_slots`, `page_size`, `policy` (an `AllocPolicy`).
    """

    def __init__(self, num_slots: int, page_size: int = 1, policy: AllocPolicy | str = "contiguous") -> None:
        try:
            pol = AllocPolicy(policy)
        except ValueError:
            known = [p.value for p in AllocPolicy]
            raise SlotError(f"unknown allocation policy {policy!r}; known: {known}") from None
        if not _is_int(num_slots) or num_slots <= 0:
            raise SlotError(f"num_slots must be a positive int, got {num_slots!r}")
        if not _is_int(page_size) or page_size <= 0:
            raise SlotError(f"page_size must be a positive int, got {page_size!r}")
        if num_slots % page_size:
            raise SlotError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        self.num_slots: int = int(num_slots)
        self.page_size: int = int(page_size)
        self.policy: AllocPolicy = pol
        self._num_pages: int = self.num_slots // self.page_size
        self._free_pages: int = self._num_pages
        self._state: np.ndarray = np.zeros(self._num_pages, dtype=np.int8)
        # Slot offsets inside one page, reused to expand page ids into slot ids.
        self._offsets: np.ndarray = np.arange(self.page_size, dtype=np.int64)

        # first_fit: FIFO of page-id segments; the head segment is consumed from
        # `_head_pos` on, so taking from it never copies the rest of the segment.
        self._segments: deque[np.ndarray] = deque()
        self._head_pos: int = 0
        # contiguous: free runs in pages, start -> length and end (exclusive) ->
        # start for O(1) neighbour merging, plus (length, start) sorted for best
        # fit and largest-first.
        self._run_len: dict[int, int] = {}
        self._run_start_of_end: dict[int, int] = {}
        self._runs_by_size: SortedList = SortedList()

        if pol is AllocPolicy.FIRST_FIT:
            self._segments.append(np.arange(self._num_pages, dtype=np.int64))
            self._ids = None
        else:
            self._add_run(0, self._num_pages)
            # Every slot id once: a run's ids are a view of it, so handing out a long run
            # writes no ids at all.
            self._ids = np.arange(self.num_slots, dtype=np.int64)

    def available(self) -> int:
        """Number of free slots."""
        return self._free_pages * self.page_size

    def free_runs(self) -> int:
        """Number of maximal extents of consecutive free slot ids (first_fit: one pass over the pages)."""
        if self.policy is AllocPolicy.CONTIGUOUS:
            return len(self._run_len)
        return len(self._physical_runs()[0])

    def largest_free_run(self) -> int:
        """Length in slots of the longest extent of consecutive free slots (0 if none)."""
        if self.policy is AllocPolicy.CONTIGUOUS:
            return self._runs_by_size[-1][0] * self.page_size if self._runs_by_size else 0
        starts, ends = self._physical_runs()
        return int((ends - starts).max()) * self.page_size if len(starts) else 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """`[n]` int64 CPU tensor of distinct free slot ids in whole pages; `None` iff fewer are free.

        `n`: a positive multiple of `page_size`, else `SlotError`. The tensor is read-only
        by contract (see `alloc_runs`).
        """
        got = self.alloc_runs(n)
        return None if got is None else got[0]

    def alloc_runs(self, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        """`alloc(n)` and the runs it is made of: `(slots, [(first slot, length), ...])` in order.

        Contiguous policy: a one-run allocation's slots are a view of the allocator's table
        of slot ids: read them, never write them.
        """
        if not _is_int(n) or n <= 0 or n % self.page_size:
            raise SlotError(
                f"alloc size must be a positive int multiple of page_size={self.page_size}, got {n!r}"
            )
        k = int(n) // self.page_size
        if k > self._free_pages:
            return None
        ps = self.page_size
        if self.policy is AllocPolicy.FIRST_FIT:
            pages = self._take_fifo(k)
            slots = (pages[:, None] * ps + self._offsets).reshape(-1)
            heads = np.flatnonzero(np.diff(pages, prepend=pages[0] - 2) != 1)
            lens = np.diff(np.append(heads, len(pages)))
            runs = list(zip((pages[heads] * ps).tolist(), (lens * ps).tolist(), strict=True))
        else:
            slots, runs = self._take_runs(k)
        self._free_pages -= k
        return torch.from_numpy(slots), runs

    def _take_fifo(self, k: int) -> np.ndarray:
        """Pop `k` pages from the head of the free list; returns them as `int64`."""
        # Plan first without mutating, so a corrupt free list changes nothing.
        parts: list[np.ndarray] = []
        need = k
        pos = self._head_pos
        for seg in self._segments:
            part = seg[pos : pos + need]
            parts.append(part)
            need -= len(part)
            pos = 0
            if need == 0:
                break
        pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if (self._state[pages] == _LIVE).any():
            self._raise_corrupt(pages)
        self._state[pages] = _LIVE
        # Commit: drop the fully consumed segments, advance into the last one.
        for _ in range(len(parts) - 1):
            self._segments.popleft()
            self._head_pos = 0
        self._head_pos += len(parts[-1])
        if self._head_pos == len(self._segments[0]):
            self._segments.popleft()
            self._head_pos = 0
        return pages

    def _take_runs(self, k: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Take `k` pages from the free runs: their slot ids (`int64`) and `(first slot, length)` runs."""
        ps = self.page_size
        sizes = self._runs_by_size
        i = sizes.bisect_left((k, -1))
        if i < len(sizes):
            # Best fit: the smallest run that holds k pages (lowest start on ties).
            length, start = sizes[i]
            plan = [(length, start, k)]
        else:
            # No single run fits: the largest runs first, the last one in part.
            plan = []
            need = k
            j = len(sizes) - 1
            while need:
                length, start = sizes[j]
                take = min(length, need)
                plan.append((length, start, take))
                need -= take
                j -= 1
        for _, start, take in plan:
            if (self._state[start : start + take] == _LIVE).any():
                self._raise_corrupt(np.arange(start, start + take))
        out = []
        for length, start, take in plan:
            self._remove_run(start, length)
            if take < length:
                self._add_run(start + take, length - take)
            self._state[start : start + take] = _LIVE
            out.append(self._ids[start * ps : (start + take) * ps])
        runs = [(start * ps, take * ps) for _, start, take in plan]
        return (out[0] if len(out) == 1 else np.concatenate(out)), runs

    def _raise_corrupt(self, pages: np.ndarray) -> None:
        live = pages[self._state[pages] == _LIVE]
        raise AllocatorCorruptError(
            f"double allocation: free structure ({self.policy.value}) names pages "
            f"{fmt_ids(live)} that are still allocated"
        )

    def free(self, slots: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Give back allocated slots (`[n]` ids: a tensor on any device, an array or a list); all or nothing.

        They must be in range, distinct, allocated and whole pages, else `SlotError` naming
        the offending ids; they need not come from one `alloc` call.
        """
        if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
            slots = slots.cpu()  # ids handed back from a device tensor are still ids
        arr = as_slots("slots to free", slots, self.num_slots, distinct=True)
        if arr.size == 0:
            return
        pages = self._validate_free(arr)
        self._state[pages] = _FREED
        self._free_pages += len(pages)
        if self.policy is AllocPolicy.FIRST_FIT:
            self._segments.append(self._fifo_order(arr))
        else:
            self._insert_pages(pages)

    def _validate_free(self, arr: np.ndarray) -> np.ndarray:
        """Check a free request of in-range, distinct ids; returns its page ids, sorted, `int64`."""
        ps = self.page_size
        # Runs handed back whole come ascending: sorting them again would cost a second sort.
        srt = arr if bool((arr[1:] > arr[:-1]).all()) else np.sort(arr)
        if ps == 1:
            pages = srt
        else:
            # Sorted and distinct: whole pages iff each group of page_size ids is
            # page*page_size + 0..page_size-1.
            whole = len(srt) % ps == 0
            if whole:
                grid = srt.reshape(-1, ps)
                whole = bool(((grid[:, 0] % ps) == 0).all() and (grid - grid[:, :1] == self._offsets).all())
            if not whole:
                upages, counts = np.unique(srt // ps, return_counts=True)
                partial = upages[counts != ps]
                bad = srt[np.isin(srt // ps, partial)]
                raise SlotError(
                    f"free of partial pages (page_size={ps}): pages {fmt_ids(partial)} "
                    f"via slots {fmt_ids(bad)}"
                )
            pages = srt[::ps] // ps
        state = self._state[pages]
        if (state != _LIVE).any():
            msgs = []
            for code, what in ((_FREED, "already freed (double free)"), (_NEVER, "never allocated")):
                bad_pages = pages[state == code]
                if len(bad_pages):
                    bad = srt[np.isin(srt // ps, bad_pages)]
                    msgs.append(f"{what}: {fmt_ids(bad)}")
            raise SlotError("cannot free slots that are not allocated; " + "; ".join(msgs))
        return pages

    def _fifo_order(self, arr: np.ndarray) -> np.ndarray:
        """Page ids of a validated free request in the order given (own copy)."""
        if self.page_size == 1:
            return arr.copy()  # `arr` may share memory with the caller's tensor
        # Each page in the order its first slot appears in the request.
        _, first = np.unique(arr // self.page_size, return_index=True)
        return (arr[np.sort(first)] // self.page_size).astype(np.int64, copy=False)

    def _insert_pages(self, pages: np.ndarray) -> None:
        """Add sorted, distinct, just-freed pages to the runs, merging neighbours."""
        breaks = np.flatnonzero(pages[1:] != pages[:-1] + 1) + 1
        starts = pages[np.concatenate(([0], breaks))].tolist()
        ends = (pages[np.concatenate((breaks - 1, [len(pages) - 1]))] + 1).tolist()
        for start, end in zip(starts, ends, strict=True):
            left = self._run_start_of_end.get(start)
            if left is not None:
                self._remove_run(left, start - left)
                start = left
            right_len = self._run_len.get(end)
            if right_len is not None:
                self._remove_run(end, right_len)
                end += right_len
            self._add_run(start, end - start)

    def _add_run(self, start: int, length: int) -> None:
        self._run_len[start] = length
        self._run_start_of_end[start + length] = start
        self._runs_by_size.add((length, start))

    def _remove_run(self, start: int, length: int) -> None:
        del self._run_len[start]
        del self._run_start_of_end[start + length]
        self._runs_by_size.remove((length, start))

    def _physical_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and end (exclusive) pages of the maximal free extents, by scan."""
        free = np.concatenate(([False], self._state != _LIVE, [False]))
        edges = np.flatnonzero(free[1:] != free[:-1])
        return edges[0::2], edges[1::2]

    def allocated_mask(self) -> np.ndarray:
        """`[num_slots]` bool, True where a slot is allocated (O(pool); for checks and debugging)."""
        return np.repeat(self._state == _LIVE, self.page_size)

    def check_invariants(self) -> None:
        """`InvariantError` naming the first disagreement of the free structure and the page states."""
        free_mask = self._state != _LIVE
        _require(int(free_mask.sum()) == self._free_pages, "the free page count disagrees with the states")
        if self.policy is AllocPolicy.FIRST_FIT:
            if self._segments:
                fifo = np.concatenate([self._segments[0][self._head_pos :], *list(self._segments)[1:]])
                _require(self._head_pos < len(self._segments[0]), "the FIFO head is past its segment")
            else:
                fifo = np.empty(0, dtype=np.int64)
            _require(len(fifo) == self._free_pages, "the FIFO does not hold every free page")
            _require(len(np.unique(fifo)) == len(fifo), "the FIFO names a page twice")
            _require(bool(free_mask[fifo].all()), "the FIFO names an allocated page")
            return
        starts, ends = self._physical_runs()
        expected = {int(s): int(e - s) for s, e in zip(starts, ends, strict=True)}
        _require(self._run_len == expected, "the runs are not exactly the merged free extents")
        run_ends = {s + n: s for s, n in expected.items()}
        _require(self._run_start_of_end == run_ends, "the run ends do not match the runs")
        by_size = sorted((n, s) for s, n in expected.items())
        _require(list(self._runs_by_size) == by_size, "the runs by size do not match the runs")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(f"allocator invariant broken: {what}")


def _is_int(x: object) -> bool:
    """True for Python and numpy integers, but not bools."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
