"""Tensor-parallel ranks running one engine in lockstep: rank 0 decides, every other rank follows.

Each rank holds a shard of the model (`from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))`), its own pools and its own cache, and every forward
is a collective: all ranks must run the same step over the same requests. Rank 0 (the
leader) is the only one that receives requests; each call that changes its engine
(`submit`, `cancel`, `step`, `settle`, `close`) is broadcast to the followers before the
leader runs it, and a follower (`follow`) replays the calls in the same order on its own
engine. What a rank could decide alone is decided by the leader and carried in the
broadcasts: which requests ran past their deadline (each rank's clock differs), and each
sampled token with its finish reason (`Choice`: greedy, sampled and penalised requests
alike; a follower never samples), so no rank can pick another token or stop elsewhere.
Before each forward the ranks check that they scheduled the same plan
(`RankGroup.agree_same` of its digest): a divergence raises `InvariantError` on every
rank instead of running a collective of mismatched shapes.

The broadcasts run on a gloo group of their own (CPU objects, whatever the model's
backend), created with every rank's engine, with a long timeout: a follower waits for
the next call while the server idles.

Contract: every rank builds its engine with the same arguments over the same checkpoint;
the leader's engine is driven from one thread (as any engine is). A forward that fails on
one rank only (out of memory on one GPU) leaves the others in a collective: the group
is lost, and `follow` on the failing rank raises.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.cache import CacheConfig, CacheController
from kvtier.cache.ranks import RankGroup
from kvtier.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.engine.results import Update
    from kvtier.engine.sampling import SamplingParams
    from kvtier.engine.scheduler import Request
    from kvtier.pool import DevicePool, HostPool

log = logging.getLogger(__name__)

# How long a follower waits for rank 0's next call (a server may idle that long).
CONTROL_TIMEOUT = timedelta(days=365)


class Call(str, Enum):
    """A call of the leader's engine that every follower replays."""

    SUBMIT = "submit"
    CANCEL = "cancel"
    STEP = "step"
    SETTLE = "settle"
    CLOSE = "close"


@dataclass(frozen=True)
class Message:
    """One call: `request` its request id (submit, cancel), `prompt` / `params` a submit's,
    `late` the ids of the requests a step first ends by their deadline."""

    call: Call
    request: int = 0
    prompt: np.ndarray | None = None
    params: SamplingParams | None = None
    late: tuple[int, ...] = ()


@dataclass(frozen=True)
class Choice:
    """What a request that sampled in a step got: `token` and `reason` (None: it goes on;
    "stop", "length"; "error": sampling failed, `token` is -1 and `error` says why on rank 0)."""

    token: int
    reason: str | None
    error: Exception | None = field(default=None, compare=False)


class Lockstep:
    """The broadcasts between rank 0's engine and the followers' (see the module docstring).

    Built by every rank (a collective: it creates the control group).
    """

    def __init__(self, ranks: RankGroup) -> None:
        import torch.distributed as dist

        if ranks.world < 2:
            raise ConfigError(f"lockstep needs two ranks or more, got a group of {ranks.world}")
        self.ranks = ranks
        members = None if ranks.group is None else dist.get_process_group_ranks(ranks.group)
        self._control = dist.new_group(members, backend="gloo", timeout=CONTROL_TIMEOUT)
        self._late: tuple[int, ...] = ()

    @property
    def leads(self) -> bool:
        return self.ranks.rank == 0

    def _broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.leads else None]
        dist.broadcast_object_list(box, group=self._control, group_src=0)
        return box[0]

    # -- the leader -------------------------------------------------------------------

    def submitted(self, req: Request) -> None:
        """Leader: a request passed `submit`'s checks (followers replay it with its id)."""
        if self.leads:
            self._broadcast(Message(Call.SUBMIT, req.id, req.prompt, req.params))

    def cancelled(self, req: Request) -> None:
        if self.leads:
            self._broadcast(Message(Call.CANCEL, req.id))

    def settling(self) -> None:
        if self.leads:
            self._broadcast(Message(Call.SETTLE))

    def closing(self) -> None:
        """Leader: tell the followers to close; a follower already gone is logged, not raised."""
        if not self.leads:
            return
        try:
            self._broadcast(Message(Call.CLOSE))
        except Exception:
            log.exception("telling the other ranks to close failed (a rank has gone)")

    def late(self, late: list[int]) -> list[int]:
        """The ids of the requests this step ends by their deadline: the leader's own, broadcast
        with the step; on a follower, those of the step it replays."""
        if self.leads:
            self._broadcast(Message(Call.STEP, late=tuple(late)))
            return late
        return list(self._late)

    # -- every rank ---------------------------------------------------------------------

    def same_plan(self, plan: list[tuple[Request, int]]) -> None:
        """`InvariantError` on every rank unless every rank scheduled `plan` alike (ids, tokens)."""
        digest = zlib.crc32(np.asarray([(r.id, n) for r, n in plan], dtype=np.int64).tobytes())
        try:
            self.ranks.agree_same(digest)
        except ConfigError as e:
            raise InvariantError(
                f"the ranks scheduled different steps ({e}); the group has diverged"
            ) from None

    def choices(self, mine: list[Choice] | None) -> list[Choice]:
        """The leader's choices of this step, on every rank (`mine`: the leader's; None on followers)."""
        sent = None if mine is None else [Choice(c.token, c.reason) for c in mine]  # errors stay here
        got = self._broadcast(sent)
        if got is None:
            raise InvariantError("rank 0 sent no choices for a step")
        return mine if self.leads else got

    # -- a follower ---------------------------------------------------------------------

    def follow(self, engine: Engine, on_update: Callable[[Update], None] | None = None) -> None:
        """Follower: replay rank 0's calls on `engine` until rank 0 closes; then close it.

        `on_update`: called with each `Update` of each replayed step (what rank 0's got too).
        """
        if self.leads:
            raise InvariantError("rank 0 leads; only the other ranks follow")
        live: dict[int, Request] = {}
        while True:
            m: Message = self._broadcast(None)
            if m.call is Call.SUBMIT:
                req = engine.submit(m.prompt, m.params)
                if req.id != m.request:
                    raise InvariantError(f"rank {self.ranks.rank} numbered request {m.request} as {req.id}")
                live[req.id] = req
            elif m.call is Call.CANCEL:
                if m.request in live:
                    engine.cancel(live.pop(m.request))
            elif m.call is Call.STEP:
                self._late = m.late
                for u in engine.step():
                    if on_update is not None:
                        on_update(u)
                    if u.result is not None or u.error is not None:
                        live.pop(u.request.id, None)
            elif m.call is Call.SETTLE:
                engine.settle()
            else:
                engine.close()
                return


def ranked_cache(
    device: DevicePool, host: HostPool, config: CacheConfig | None, storage: Any, ranks: RankGroup
) -> CacheController:
    """The engine's cache over its pools; over several ranks, one whose decisions the ranks agree
    on (matches agreed by an all-reduce, pages every rank holds alike written once)."""
    return CacheController(device, host, config, storage=storage, ranks=None if ranks.world == 1 else ranks)
