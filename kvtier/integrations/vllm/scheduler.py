"""The scheduler side of the connector: which of vLLM's blocks kvtier holds, and each step's moves.

vLLM runs the connector twice: in the scheduler process (here) and in each worker (`blocks`). They
share nothing but the plan the scheduler sends with every step (`StepPlan`), so the scheduler
decides everything. It names each block by kvtier's chained page hash of its tokens
(`kvtier.storage.keys.PageKeys`: the same in every process and after a restart, unlike vLLM's
block hashes, seeded per process), keeps the host index (`HostIndex`: page hash -> host slot,
least recently used out first), asks storage which pages it has, and plans per step:

- loads: the blocks vLLM allocated for the tokens kvtier answered for in `match` (whole blocks
  beyond vLLM's own prefix hit, never the block holding the prompt's last token): from a host
  slot, in the step, before the forward; where some come from storage (through staging slots),
  all of the request's are a fetch instead: the worker does them in the background and reports
  the request done (`fetched`), while vLLM keeps it waiting in its queue, not in a step;
- saves: every block a step completes that the host index does not hold yet, into a free slot or
  the least recently used one not in use this step, then (unless it came from storage) written
  through to storage by the worker. A page fetched from storage whole stays in its staging slot,
  which joins the index: it is on the host from then on, and needs no save.

A block's life as the scheduler sees it:

    absent --save planned, or fetched whole--> on host --slot reused for another page--> absent
    in storage (independent of the host index; never removed by the connector)

The worker finishes a step's loads before its forward and its saves before the next step, so a
page is loadable from the step after its save; a slot read in a step is not reused in that step,
nor a slot a fetch reads before the fetch is done.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import ConfigError
from kvtier.storage.keys import PageKeys


@dataclass(frozen=True)
class Load:
    """Fill vLLM block `block` from host slot `slot`; where `from_storage`, first read page
    `page_hash` from storage into the slot (a staging slot the index does not name; -1 where no
    slot was free: the load fails and vLLM recomputes the block)."""

    block: int
    slot: int
    page_hash: bytes
    from_storage: bool = False


@dataclass(frozen=True)
class Save:
    """Copy vLLM block `block` into host slot `slot` (page `page_hash`); where `store`, write the
    slot's page to storage afterwards."""

    block: int
    slot: int
    page_hash: bytes
    store: bool


@dataclass
class StepPlan:
    """One step's moves, sent from the scheduler to every worker (picklable)."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    fetches: dict[str, list[Load]] = field(default_factory=dict)


class HostIndex:
    """Page hash -> host slot for `slots` slots, least recently used first out."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ConfigError(f"the host pool holds no block (slots={slots}); raise host_gb")
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._pages: OrderedDict[bytes, int] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def free(self) -> int:
        """Slots that hold no page and are not staging one."""
        return len(self._free)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def slot(self, page_hash: bytes) -> int | None:
        return self._pages.get(page_hash)

    def touch(self, page_hash: bytes) -> None:
        self._pages.move_to_end(page_hash)

    def take(self, busy: set[int]) -> int | None:
        """A slot to write: a free one, else the least recently used page's not in `busy` (its page
        leaves the index); None where every slot is busy."""
        if self._free:
            return self._free.pop()
        for page, slot in self._pages.items():
            if slot not in busy:
                del self._pages[page]
                self.evictions += 1
                return slot
        return None

    def put(self, page_hash: bytes, slot: int) -> None:
        self._pages[page_hash] = slot

    def release(self, slot: int) -> None:
        """Give back a slot that holds no indexed page (a staging slot)."""
        self._free.append(slot)


@dataclass
class _Request:
    """What the scheduler tracks of one running request: its block table (group 0), its pages'
    hashes as far as computed, and how many of its blocks are saved or held already."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    done: int = 0
    from_storage: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Match:
    start: int  # the first block kvtier answers for
    host: list[int]  # host slots of the blocks found on the host, in order
    stored: int  # blocks found in storage after those


class ConnectorScheduler:
    """The scheduler side; see the module docstring.

    `tokens(req_id)`: a request's token ids so far (prompt and output); `stored(keys)`: how many
    of `keys`, from the first, storage holds (None: no storage tier).
    """

    def __init__(
        self,
        block_size: int,
        host_slots: int,
        keys: PageKeys,
        tokens: Callable[[str], Sequence[int]],
        stored: Callable[[list[str]], int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.index = HostIndex(host_slots)
        self.keys = keys
        self._tokens = tokens
        self._stored = stored
        self._requests: dict[str, _Request] = {}
        self._matches: dict[str, _Match] = {}
        self._plan = StepPlan()
        self._busy: set[int] = set()
        self._staging: list[int] = []
        self._held: dict[str, tuple[set[int], list[Load]]] = {}  # per fetch: slots read, its staged loads
        self.counts = {"host_hit_blocks": 0, "storage_hit_blocks": 0, "saved_blocks": 0}

    # -- per request -------------------------------------------------------------------

    def match(self, req_id: str, num_computed: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed` (vLLM's own prefix hit, whole blocks) that kvtier can load:
        whole blocks on the host, then in storage; never the block of the prompt's last token. And
        whether they load in the background (some come from storage)."""
        tokens = self._tokens(req_id)
        bs = self.block_size
        most = (len(tokens) - 1) // bs
        start = num_computed // bs
        if most <= start:
            self._matches.pop(req_id, None)
            return 0, False
        state = self._requests.setdefault(req_id, _Request())
        hashes = self._hashes(state, tokens, most)
        host = []
        for h in hashes[start:most]:
            slot = self.index.slot(h)
            if slot is None:
                break
            host.append(slot)
        stored = 0
        first = start + len(host)
        if self._stored is not None and first < most:
            stored = self._stored(self.keys.keys(hashes[first:most]))
        self._matches[req_id] = _Match(start, host, stored)
        return (len(host) + stored) * bs - (num_computed - start * bs), stored > 0

    def allocated(self, req_id: str, blocks: Sequence[int], num_external: int) -> None:
        """vLLM allocated `blocks` (the request's whole block table) and will have kvtier load
        `num_external` tokens: plan their loads for this step."""
        match = self._matches.get(req_id)
        if num_external <= 0 or match is None:
            self._matches.pop(req_id, None)
            return
        state = self._requests[req_id]
        fetch = match.stored > 0
        loads, read, staging = [], set(), []
        busy = self._busy | self._held_slots()
        for i in range(-(-num_external // self.block_size)):
            b = match.start + i
            page = state.hashes[b]
            if i < len(match.host):
                slot = match.host[i]
                self.index.touch(page)
                loads.append(Load(blocks[b], slot, page))
                self.counts["host_hit_blocks"] += 1
            else:
                # Not a slot this request reads its host hits from, nor one in use.
                slot = self.index.take(busy | read)
                if slot is None:  # every slot in use: the load fails, vLLM recomputes the block
                    slot = -1
                else:
                    staging.append(slot)
                loads.append(Load(blocks[b], slot, page, from_storage=True))
                state.from_storage.add(b)
                self.counts["storage_hit_blocks"] += 1
            read.add(slot)
        if fetch:
            self._plan.fetches[req_id] = loads
            self._held[req_id] = (read, [ld for ld in loads if ld.from_storage and ld.slot >= 0])
        else:
            self._plan.loads.extend(loads)
            self._staging.extend(staging)
            self._busy |= read
        del self._matches[req_id]  # last: `fail_load` still sees a match that raised before here

    def forget_match(self, req_id: str) -> None:
        self._matches.pop(req_id, None)

    def fail_load(self, req_id: str, blocks: Sequence[int], start: int, num_external: int) -> None:
        """Plan `num_external` tokens' blocks from block `start` as failed loads (slot -1), in the
        step or as a fetch where `match` promised one, so vLLM recomputes them and, for a fetch,
        hears the request done."""
        match = self._matches.pop(req_id, None)
        if num_external <= 0:
            return
        n = -(-num_external // self.block_size)
        loads = [Load(blocks[b], -1, b"", True) for b in range(start, min(start + n, len(blocks)))]
        if match is not None and match.stored > 0:
            self._plan.fetches[req_id] = loads
        else:
            self._plan.loads.extend(loads)

    def fetched(self, req_ids: Sequence[str], failed_blocks: Collection[int] = ()) -> None:
        """The workers finished these requests' fetches (`failed_blocks`: the vLLM blocks that did
        not load): each staging slot that received its page whole joins the host index with it (a
        host hit from now on, and the request's blocks need no save), the others are freed."""
        for req_id in req_ids:
            _, staged = self._held.pop(req_id, (set(), []))
            for load in staged:
                if load.block in failed_blocks or load.page_hash in self.index:
                    self.index.release(load.slot)
                else:
                    self.index.put(load.page_hash, load.slot)

    @property
    def fetching(self) -> bool:
        """Whether a fetch is planned or running that the workers have not reported done."""
        return bool(self._held)

    def _held_slots(self) -> set[int]:
        return set().union(*(read for read, _ in self._held.values())) if self._held else set()

    def scheduled(
        self, req_id: str, blocks: Sequence[int] | None, replace: bool, computed_after: int
    ) -> None:
        """A request runs this step: its new `blocks` (appended, or the whole table where `replace`),
        and its tokens computed once the step ends: plan the saves of the blocks it completes."""
        state = self._requests.setdefault(req_id, _Request())
        if blocks is not None:
            state.blocks = list(blocks) if replace else state.blocks + list(blocks)
        tokens = self._tokens(req_id)
        full = min(computed_after, len(tokens), len(state.blocks) * self.block_size) // self.block_size
        if full <= state.done:
            return
        hashes = self._hashes(state, tokens, full)
        planned = {s.page_hash for s in self._plan.saves}
        held = self._held_slots()
        for b in range(state.done, full):
            page = hashes[b]
            if page in self.index:
                self.index.touch(page)
                continue
            if page in planned:
                continue
            slot = self.index.take(self._busy | held)
            if slot is None:
                full = b  # the host is busy: try again next step
                break
            self.index.put(page, slot)
            self._busy.add(slot)
            store = self._stored is not None and b not in state.from_storage
            self._plan.saves.append(Save(state.blocks[b], slot, page, store))
            self.counts["saved_blocks"] += 1
        state.done = max(state.done, full)

    def finished(self, req_id: str) -> None:
        """The request ended (its fetch, if any, stays held until `fetched`)."""
        self._requests.pop(req_id, None)
        self._matches.pop(req_id, None)

    def state(self) -> dict[str, int]:
        """What the scheduler holds now (a debug surface): once vLLM is idle and every fetch is
        reported, `requests`, `matches`, `fetches`, `held_slots`, `staging` and `planned` are 0 and
        `free_slots + indexed == host_slots`."""
        plan = self._plan
        return {
            "requests": len(self._requests),
            "matches": len(self._matches),
            "fetches": len(self._held),
            "held_slots": len(self._held_slots() | self._busy),
            "staging": len(self._staging) + sum(len(st) for _, st in self._held.values()),
            "planned": len(plan.loads) + len(plan.saves) + len(plan.fetches),
            "host_slots": self.index.slots,
            "free_slots": self.index.free,
            "indexed": len(self.index),
        }

    # -- per step ----------------------------------------------------------------------

    def take_plan(self) -> StepPlan:
        """This step's plan; the next step starts empty, its staging slots free again."""
        plan, self._plan = self._plan, StepPlan()
        for slot in self._staging:
            self.index.release(slot)
        self._staging, self._busy = [], set()
        return plan

    def _hashes(self, state: _Request, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The request's page hashes up to `blocks` whole blocks, extending the ones known."""
        have = len(state.hashes)
        if blocks > have:
            bs = self.block_size
            parent = state.hashes[-1] if have else self.keys.root
            more = np.asarray(tokens[have * bs : blocks * bs], dtype=np.int64)
            state.hashes.extend(self.keys.chain(parent, more))
        return state.hashes
