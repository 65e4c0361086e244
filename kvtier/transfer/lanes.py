"""Where transfers run: CUDA streams and events, or a deferred CPU stand-in with the same contract.

A mover submits work to a `Lane` (a stream) and gets `Signal`s (events) back; nothing waits on a
device but through a signal. On the CPU a lane runs its queue only when a signal on it is waited
for or it is drained, so tests see a GPU's asynchrony: a bug that frees memory before a transfer
completes corrupts data instead of passing by luck.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import overload

import torch

from kvtier.errors import TransferError
from kvtier.transfer import cudart
from kvtier.transfer.native import Job

# `submit(current, order, events, streams, forks, device)`: see `CudaLane.run_native`.
NativeSubmit = Callable[[int, int, list[int], list[int], list[int], int | None], Job | None]


class Signal(ABC):
    """A point in some work: `query()` without waiting, `wait_host()` blocking, `make_current_wait()`.

    Lanes make them for device work; any mover (a storage tier's threads, say) may make its own.
    """

    @abstractmethod
    def query(self) -> bool:
        """Whether the work up to this point has finished."""

    @abstractmethod
    def wait_host(self) -> None:
        """Block the calling thread until it has."""

    @abstractmethod
    def make_current_wait(self) -> None:
        """Make the current compute stream wait for this point (no host wait where a device can)."""


class Lane(ABC):
    """An ordered queue of transfer work."""

    @abstractmethod
    def submit(self, fn: Callable[[], None]) -> None:
        """Queue `fn` (which enqueues device work on `stream`, or does CPU work in order)."""

    @abstractmethod
    def signal(self) -> Signal:
        """A signal after everything submitted so far."""

    @abstractmethod
    def wait_for_current(self) -> None:
        """Order this lane's later work after the work queued on the current compute stream."""

    @abstractmethod
    def drain(self) -> None:
        """Run (or wait for) everything submitted so far."""

    def run_each(self, jobs: list[Callable[[], None]]) -> list[Signal]:
        """Submit each job and a signal after it (per-layer readiness)."""
        signals = []
        for job in jobs:
            self.submit(job)
            signals.append(self.signal())
        return signals

    def run_native(
        self, submit: NativeSubmit, signals: int, streams: int = 1, off_thread: bool = False
    ) -> Sequence[Signal]:
        """Submit an operation from compiled code (CUDA lanes only; see `CudaLane.run_native`)."""
        raise TransferError(f"{type(self).__name__} has no stream to submit compiled calls on")

    @property
    def stream(self) -> torch.cuda.Stream | None:
        return None


class CudaSignal(Signal):
    """A recorded event; with `pool`, the event goes back to it when the signal is dropped; with
    `gate` `(job, i)`, the event is signal i of a job still being submitted from another thread."""

    def __init__(
        self,
        event: torch.cuda.Event,
        pool: list[torch.cuda.Event] | None = None,
        gate: tuple[Job, int] | None = None,
    ) -> None:
        self.event = event
        self._pool = pool
        self._gate = gate

    def _recorded(self, wait: bool) -> bool:
        return self._gate is None or self._gate[0].recorded(self._gate[1], wait)

    def __del__(self) -> None:
        # Nobody can query or wait on this recording any more; a later record may reuse the event
        # (a stream already told to wait keeps waiting for this recording, as CUDA defines it).
        if self._pool is not None:
            self._pool.append(self.event)

    def query(self) -> bool:
        return self._recorded(False) and self.event.query()

    def wait_host(self) -> None:
        self._recorded(True)
        self.event.synchronize()

    def make_current_wait(self) -> None:
        self._recorded(True)
        torch.cuda.current_stream().wait_event(self.event)


class CudaLane(Lane):
    """A CUDA stream of its own (never the legacy default stream). An operation submitted from
    another thread (`run_native(off_thread=True)`) holds the stream's host side until it is made:
    every other use of the lane first waits for that (`settle`)."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        self._events: list[torch.cuda.Event] = []  # recorded before, free to record again
        # Per count k: the raw handles of the lane's stream and k - 1 side streams, and of an event
        # per stream (`run_native`); the torch objects are kept alive with them.
        self._fans: dict[int, tuple[list[int], list[int], list]] = {}
        self._device_index = self._stream.device.index
        rt = cudart.runtime()
        self._raw_record = rt.event_record if rt is not None else None
        self._raw_wait = rt.stream_wait_event if rt is not None else None
        # The current stream's raw handle without building a torch Stream object (which cost
        # a reload's submission more than its runtime calls: bench/FINDINGS.md).
        self._current_raw = torch._C._cuda_getCurrentRawStream
        self._pending: Job | None = None

    def settle(self) -> None:
        """Wait until an operation submitted from another thread has made its calls."""
        if self._pending is not None:
            job, self._pending = self._pending, None
            job.finish()

    def _record(self) -> CudaSignal:
        # A pooled event already has its CUDA handle (torch makes it on the first record): record
        # it again with one raw runtime call, cheaper per layer than torch's.
        event = self._events.pop() if self._events else None
        if event is not None and self._raw_record is not None:
            cudart.check(self._raw_record(event.cuda_event, self._stream.cuda_stream), "cudaEventRecord")
        else:
            event = event or torch.cuda.Event()
            event.record(self._stream)
        return CudaSignal(event, self._events)

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    def submit(self, fn: Callable[[], None]) -> None:
        self.settle()
        with torch.cuda.stream(self._stream):
            fn()

    def signal(self) -> Signal:
        self.settle()
        return self._record()

    def wait_for_current(self) -> None:
        self.settle()
        if self._raw_wait is None or not self._events:
            event = self._events.pop() if self._events else torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._stream.device))
            self._stream.wait_event(event)
        else:
            event = self._events.pop()  # pooled: it has its handle
            self._wait_behind(event, self._current_raw(self._device_index))
        self._events.append(event)  # the wait is enqueued: a later record cannot change it

    def _wait_behind(self, event: torch.cuda.Event, current: int) -> None:
        """Order this lane's stream after raw stream `current`'s work, through `event` (it has a handle)."""
        cudart.check(self._raw_record(event.cuda_event, current), "cudaEventRecord")
        cudart.check(self._raw_wait(self._stream.cuda_stream, event.cuda_event, 0), "cudaStreamWaitEvent")

    def drain(self) -> None:
        self.settle()
        self._stream.synchronize()

    def run_native(
        self, submit: NativeSubmit, signals: int, streams: int = 1, off_thread: bool = False
    ) -> Sequence[Signal]:
        """Submit one operation from compiled code, after the work queued on the current stream:
        `submit(current, order, events, streams, forks, device)` orders the lane's stream after raw
        stream `current` with raw event `order`, forks `streams` (the lane's, then side streams) with
        the raw events `forks`, and records `events` where the `signals` belong (after each layer, or
        at the end after the join). If `submit` raises, the events go back to the pool. `off_thread`:
        the order is taken here and the calls are made from a thread of the loop's own (`device`),
        the signals waiting for their events' records; inline where no thread starts."""
        self.settle()
        order, *events = self._take_events(signals + 1)
        fan, forks, held = self._fan(streams)
        raw, current, job = [e.cuda_event for e in events], self._current_raw(self._device_index), None
        try:
            if off_thread and self._raw_wait is not None:
                self._wait_behind(order, current)
                job = submit(0, 0, raw, fan, forks, self._device_index)
            if job is None:
                submit(current, order.cuda_event, raw, fan, forks, None)
        except BaseException:
            self._events += events  # no signal holds them
            raise
        finally:
            self._events.append(order)  # the wait is enqueued: a later record cannot change it
        if job is not None:
            job.keep += (events, held, self._stream)  # the loop's thread records and uses them
            self._pending = job
        return EventSignals(events, self._events, job)

    def _fan(self, k: int) -> tuple[list[int], list[int], list]:
        """This lane's stream and `k - 1` side streams, and an event per stream (made once per k)."""
        found = self._fans.get(k)
        if found is None:
            main = self._stream
            side = [torch.cuda.Stream(main.device, priority=main.priority) for _ in range(k - 1)]
            forks = [torch.cuda.Event() for _ in range(k)]
            for event in forks:
                event.record(main)  # its handle exists from now on
            handles = [s.cuda_stream for s in (main, *side)]
            found = self._fans[k] = (handles, [e.cuda_event for e in forks], [side, forks])
        return found

    def _take_events(self, k: int) -> list[torch.cuda.Event]:
        """`k` events with CUDA handles: pooled ones first, new ones recorded once to make theirs."""
        pool = self._events
        out = pool[len(pool) - min(k, len(pool)) :]
        del pool[len(pool) - len(out) :]
        while len(out) < k:
            event = torch.cuda.Event()
            event.record(self._stream)  # recorded again by the loop, after the layer's copies
            out.append(event)
        return out

    def run_each(self, jobs: list[Callable[[], None]]) -> list[Signal]:
        # One stream context for all jobs and events from the pool: this loop is the per-layer
        # submission cost of a reload.
        self.settle()
        signals: list[Signal] = []
        with torch.cuda.stream(self._stream):
            for job in jobs:
                job()
                signals.append(self._record())
        return signals


class EventSignals(Sequence[Signal]):
    """A signal per recorded event, each made when first asked for (a reload records one per layer).

    Events whose signal was never made go back to `pool` with this object; a signal that was
    made gives its own event back when it is dropped. `signals[i]` is the same object each time;
    with `job`, each waits for its event to be recorded from the job's thread (`CudaSignal`).
    """

    def __init__(
        self, events: list[torch.cuda.Event], pool: list[torch.cuda.Event], job: Job | None = None
    ) -> None:
        self._events = events
        self._made: list[CudaSignal | None] = [None] * len(events)
        self._pool = pool
        self._job = job

    def __len__(self) -> int:
        return len(self._events)

    @overload
    def __getitem__(self, i: int) -> Signal: ...

    @overload
    def __getitem__(self, i: slice) -> list[Signal]: ...

    def __getitem__(self, i: int | slice) -> Signal | list[Signal]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self._events))[i]  # signals[-1] is the last layer's, gated as the last
        made = self._made[i]
        if made is None:
            gate = None if self._job is None else (self._job, i)
            made = self._made[i] = CudaSignal(self._events[i], self._pool, gate)
        return made

    def __del__(self) -> None:
        self._pool.extend(e for e, made in zip(self._events, self._made, strict=True) if made is None)


class DeferredSignal(Signal):
    def __init__(self, lane: DeferredLane, ticket: int) -> None:
        self.lane, self.ticket = lane, ticket

    def query(self) -> bool:
        return self.lane.done >= self.ticket

    def wait_host(self) -> None:
        self.lane.run_until(self.ticket)

    def make_current_wait(self) -> None:
        # The CPU "compute stream" is the caller itself: it can only proceed once done.
        self.lane.run_until(self.ticket)


class DeferredLane(Lane):
    """CPU stand-in for a stream: work runs in order, only when someone waits for it.

    `step(n)` runs the next `n` queued items, as a GPU would progress on its own.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self._issued = 0
        self.done = 0

    def submit(self, fn: Callable[[], None]) -> None:
        self._issued += 1
        self._queue.append((self._issued, fn))

    def signal(self) -> Signal:
        # A signal after the last item; an empty item keeps tickets strictly ordered.
        self.submit(lambda: None)
        return DeferredSignal(self, self._issued)

    def wait_for_current(self) -> None:
        """The CPU "compute stream" is the caller itself: its work is done when it calls."""

    def run_until(self, ticket: int) -> None:
        while self.done < ticket and self._queue:
            n, fn = self._queue.popleft()
            fn()
            self.done = n

    def step(self, items: int = 1) -> None:
        for _ in range(items):
            if not self._queue:
                return
            self.run_until(self._queue[0][0])

    def drain(self) -> None:
        self.run_until(self._issued)


def make_lane(device: torch.device) -> Lane:
    return CudaLane(device) if device.type == "cuda" else DeferredLane()
