"""The worker thread of `kvtier serve`: it owns the engine, submits jobs and steps while any runs.

A `Job` is one HTTP request on its way through the worker; `events` carries its tokens
and its end ("done", "error", "cancelled") back to the event loop. Between steps the
worker takes every job queued (a job whose client has gone is dropped before it is
submitted), cancels the requests whose clients went away (their slots are freed and what
was computed inserted at once) and routes each step's tokens and results to their jobs.
A job the engine refuses, or a step that fails, answers its jobs with the error; the
worker keeps serving. When the engine is idle it settles the cache (see `Worker._next`).

Shutdown (`drain(deadline)`): the worker keeps stepping what it holds until the deadline
(`time.monotonic()`), then cancels every request it runs or holds queued and answers each
with `SHUTDOWN` (503); a job that comes after the deadline gets the same at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.engine import Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Request
from kvtier.errors import APIError, ConfigError, PromptTooLongError

log = logging.getLogger(__name__)

# How long the worker waits for another request before it settles the cache's transfers.
IDLE_S = 0.05
# Put on the queue to wake a waiting worker (`drain`); no request.
_WAKE = "wake"
# The answer to a request the server cancels because it is shutting down.
SHUTDOWN = APIError(
    503, "the server shut down before this request finished", type_="server_error", code="shutting_down"
)


@dataclass(eq=False)
class Job:
    """One request on its way through the worker; `events` carries tokens back to the event loop."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """The thread that owns the engine: submits jobs as they come and steps while any is in it.

    Between steps it takes every job queued (a job whose client has gone is dropped
    before it is submitted), cancels the requests whose clients went away (their slots
    are freed and what was computed inserted at once) and routes each step's tokens and
    results to their jobs. A job the engine refuses, or a step that fails, answers its
    jobs with the error; the worker keeps serving.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cancelled = 0  # requests stopped because their client went away
        self.jobs: queue.Queue[Job | str | None] = queue.Queue()
        self._active: dict[Request, Job] = {}
        self._pending: Job | None = None  # the job being submitted
        self._deadline: float | None = None  # set by `drain`: when what is left is cancelled
        self.aborted = 0  # requests cancelled at shutdown
        self.thread = threading.Thread(target=self._run, name="kvtier-worker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            log.error("the worker did not stop within 30 s (an engine step still runs)")

    def drain(self, deadline: float) -> None:
        """Step what is held until `deadline` (`time.monotonic()`), then cancel it all with `SHUTDOWN`."""
        self._deadline = deadline
        self.jobs.put(_WAKE)  # a worker waiting for a job looks at the deadline

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _next(self) -> Job | str | None:
        """The next job when the engine is idle; once none has come for `IDLE_S`, the cache is
        settled before waiting on.

        Settling runs the backups of the requests answered (on the CPU nothing runs them
        otherwise), which starts their write-through storage writes: another server sharing
        the store can then read the pages while this one idles.
        """
        try:
            return self.jobs.get(timeout=IDLE_S)
        except queue.Empty:
            pass
        if not self.engine.closed:
            try:
                self.engine.settle()
            except Exception:
                log.exception("settling the cache between requests failed")
        if self._deadline is not None and not self._past_deadline():  # draining: wake at the deadline
            return self.jobs.get(timeout=max(0.0, self._deadline - time.monotonic()))
        return self.jobs.get()

    @property
    def alive(self) -> bool:
        """Whether the worker still serves (False once stopped, or after an error it could not handle)."""
        return self.thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            log.critical("the worker stopped on an error; the server answers 503 from now on", exc_info=True)
            stranded = [*self._active.values(), *([self._pending] if self._pending else [])]
            while True:
                try:
                    stranded.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in stranded:
                if isinstance(job, Job):
                    job.emit("error", RuntimeError("the server's worker stopped"))
            raise

    def _serve(self) -> None:
        running = True
        while running:
            if not self.engine.busy:
                try:
                    job = self._next()
                except queue.Empty:  # draining and idle until the deadline
                    job = _WAKE
                if job is None:
                    break
                self._submit(job)
            while True:  # every job queued meanwhile joins the next step
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    running = False
                    break
                self._submit(job)
            self._cancel_gone()
            if self._past_deadline():
                self._abort()
            if running and self.engine.busy:
                self._step()
        for req, job in list(self._active.items()):  # stopping: what runs is cancelled
            self.engine.cancel(req)
            job.emit("cancelled", None)
        self._active.clear()

    def _abort(self) -> None:
        """Past the shutdown deadline: cancel every request held, each answered `SHUTDOWN`."""
        if not self._active:
            return
        for req, job in list(self._active.items()):
            self.engine.cancel(req)
            job.emit("error", SHUTDOWN)
        log.warning("shutting down: %d requests cancelled at the deadline", len(self._active))
        self.aborted += len(self._active)
        self._active.clear()

    def _submit(self, job: Job | str) -> None:
        if not isinstance(job, Job) or job.cancel.is_set():
            return
        if self._past_deadline():
            job.emit("error", SHUTDOWN)
            self.aborted += 1
            return
        self._pending = job
        try:
            self._active[self.engine.submit(job.prompt, job.params)] = job
        except (PromptTooLongError, ConfigError) as e:  # refused: the client's to fix
            log.info("request refused: %s", e)
            job.emit("error", e)
        except Exception as e:
            log.exception("submitting a request failed")
            job.emit("error", e)
        self._pending = None

    def _cancel_gone(self) -> None:
        for req, job in list(self._active.items()):
            if job.cancel.is_set():
                self.engine.cancel(req)  # inserts what was computed, frees the rest, releases the lease
                del self._active[req]
                self.cancelled += 1
                job.emit("cancelled", None)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as e:  # the engine could not step at all: fail what it runs
            log.exception("an engine step failed")
            for req, job in list(self._active.items()):
                self.engine.cancel(req)
                job.emit("error", e)
            self._active.clear()
            return
        for u in updates:
            job = self._active.get(u.request)
            if job is None:
                continue
            if u.token is not None:
                job.emit("token", u.token)
            if u.error is not None:
                job.emit("error", u.error)
            elif u.result is not None:
                job.emit("done", u.result)
            if u.error is not None or u.result is not None:
                del self._active[u.request]
