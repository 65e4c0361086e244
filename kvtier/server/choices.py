"""The engine requests of one HTTP request's choices: their events merged, or drained to results.

A request with `n` choices (of each of its prompts) is one worker `Job` per choice.
`events(jobs)` yields every job's events as they come, tagged with the job's index, until
each job has ended; `drain(jobs, request)` waits for every result of a non-streamed
request. However a request ends (answered, failed, its client gone), every one of its jobs
is marked cancelled: the worker stops those still running at their next token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from kvtier.engine.results import RequestResult
from kvtier.errors import APIError
from kvtier.server import protocol as api
from kvtier.server.worker import Job

# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.2


async def events(jobs: list[Job]) -> AsyncIterator[tuple[int, str, Any]]:
    """Every job's events as they come, with the job's index, until each job has ended."""
    merged: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    async def forward(i: int, job: Job) -> None:
        kind = "token"
        while kind == "token":
            kind, value = await job.events.get()
            merged.put_nowait((i, kind, value))

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            i, kind, value = await merged.get()
            running -= kind != "token"
            yield i, kind, value
    finally:
        for task in tasks:
            task.cancel()


async def drain(jobs: list[Job], request: Request) -> list[RequestResult]:
    """The results of non-streamed jobs, in order; a client that goes away meanwhile cancels them,
    and so does one job's failure the others."""
    watch = asyncio.create_task(cancel_when_gone(jobs, request))
    results: list[RequestResult | None] = [None] * len(jobs)
    try:
        async with aclosing(events(jobs)) as merged:
            async for i, kind, value in merged:
                if kind == "done":
                    results[i] = value
                elif kind == "error":
                    raise api.failure_error(value)
                elif kind == "cancelled":
                    raise APIError(499, "request cancelled", type_="cancelled")
        return results
    finally:
        watch.cancel()
        for job in jobs:
            job.cancel.set()  # the others of a failed request stop at their next token


async def cancel_when_gone(jobs: list[Job], request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    for job in jobs:
        job.cancel.set()
