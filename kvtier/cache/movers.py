"""Movers: the half of the cache that moves bytes, one per pair of tiers.

The manager decides what moves and when; a mover only moves bytes between two tiers and
reports completion, never touching the tree, the allocators or a node.

Contract of a `Mover[Op, H]` (one interface for every pair of tiers):

- `submit(op: Op) -> H`: start one operation and return its handle at once. Each mover
  names its operation types and handle types; every handle is a `Handle`: `done()` polls
  without waiting, `wait()` blocks until the operation ends. `submit` raises before
  submitting anything or, failing part-way, after draining what it started, so the caller
  may free the destination slots.
- `drain()`: wait for every operation submitted so far.
- `close()`: drain (a mover may stop what it can cut short first) and take no more.

`DeviceHostMover` (`Mover[Operation, Transfer]`) moves between a `DevicePool` and a
`HostPool` through `kvtier.transfer.submit.Transfers`: one `Operation` per load or backup,
loads and backups on separate lanes (each completes its operations in order), so a reload
never waits behind a backup; a `Transfer`'s `signals` are per layer for loads, one
otherwise. `kvtier.cache.storage_mover.HostStorageMover` moves between the host and a
storage backend: its operations look pages up, read and write them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.transfer import KernelOptions, PathCosts, TransferPath
from kvtier.transfer.lanes import Lane, make_lane
from kvtier.transfer.options import MeasuredCosts
from kvtier.transfer.submit import DEFAULT_LOOP, Operation, Transfer, Transfers


class Handle(Protocol):
    """What `Mover.submit` returns: an operation in flight."""

    def done(self) -> bool:
        """Whether the operation has ended (no waiting)."""

    def wait(self) -> object:
        """Block until the operation has ended."""


Op = TypeVar("Op")
H = TypeVar("H", bound=Handle)


class Mover(ABC, Generic[Op, H]):
    """Moves bytes between two tiers; see the module docstring for the contract."""

    @abstractmethod
    def submit(self, op: Op) -> H:
        """Start `op`; returns its handle at once."""

    @abstractmethod
    def drain(self) -> None:
        """Wait for every operation submitted so far."""

    def close(self) -> None:
        """Drain; the mover takes no operation after this."""
        self.drain()


class DeviceHostMover(Mover[Operation, Transfer]):
    """Device <-> host: loads on `load_lane`, backups on `backup_lane` (see the module docstring).

    `lanes`: `(load lane, backup lane)` instead of new ones on the device pool's device, and
    `loop`: the compiled loop (see `Transfers`), for tests with stand-in runtimes.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        costs: PathCosts | MeasuredCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | None = None,
        lanes: tuple[Lane, Lane] | None = None,
        loop: object = DEFAULT_LOOP,
    ) -> None:
        self.transfers = Transfers(
            host_pool,
            device_pool,
            costs=costs,
            kernel=kernel,
            force=force,
            loop=loop,
        )
        self.load_lane, self.backup_lane = lanes or (
            make_lane(device_pool.device),
            make_lane(device_pool.device),
        )

    def lane(self, direction: Direction) -> Lane:
        return self.load_lane if direction is Direction.LOAD else self.backup_lane

    def submit(self, op: Operation) -> Transfer:
        lane = self.lane(op.direction)
        try:
            return self.transfers.submit(op, lane, per_layer=op.direction is Direction.LOAD)
        except BaseException:
            lane.drain()  # whatever the lane took may still write the destination
            raise

    def drain(self) -> None:
        self.load_lane.drain()
        self.backup_lane.drain()
