"""The routes of the app: each request admitted, read, parsed and tokenised, queued for the worker,
and answered (whole, or streamed as server-sent events).

A request's parameters are read by `kvtier.server.params` (a field the server cannot honour
is a 400 naming it). Its `n` choices (of each prompt, for a text completion with several)
are one engine request each, queued together: the first computes the prompt, the others
match it in the prefix cache; a stream interleaves their chunks, each with its `index`.

Admission (`Limits`), in this order, each refusal before any work: while the server
shuts down, 503; a body over `max_body_bytes` is answered 413 from its Content-Length
before it is read, or as soon as more arrives (a chunked body); with `max_queue` requests
waiting, 429 with `Retry-After`; a body not wholly arrived within `body_timeout_s` is
answered 408 and its slot freed; then the body is parsed and tokenised on a thread of its
own, never on the event loop, so `/health` and the streams keep answering. Each request
carries `request_timeout_s` to the engine: one that runs past it is answered 504
(streamed: an error event, then `[DONE]`).

A client that goes away before its answer ended (mid-upload, while a non-streamed request
runs, or in the middle of a stream) is counted under `status="499"` (nginx's "client
closed request"), logged in one line at INFO, and its requests cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvtier import __version__
from kvtier.engine.engine import Engine
from kvtier.engine.results import RequestResult
from kvtier.errors import APIError, ConfigError
from kvtier.server import choices
from kvtier.server import protocol as api
from kvtier.server.access import access_record, usage_of
from kvtier.server.limits import Limits
from kvtier.server.metrics import CONTENT_TYPE, ServerMetrics
from kvtier.server.params import MAX_CHOICES, Prompt, RequestParams, completion_prompts, request_params
from kvtier.server.worker import Job, Worker

log = logging.getLogger(__name__)


@dataclass
class Routes:
    """The routes: each request is admitted, parsed and tokenised here, then queued for the worker.

    Parsing and tokenisation run on `prep`, one thread of their own: off the event loop,
    and never two at once on the tokenizer. `admitting` counts the requests between the
    queue check and the worker's queue, so a burst cannot pass the bound while it is
    being tokenised.
    """

    engine: Engine
    model_name: str
    worker: Worker
    metrics: ServerMetrics
    limits: Limits
    prep: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvtier-prep")
    )
    admitting: int = 0
    draining: bool = False

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503); cancel what still runs or waits `timeout_s` from now."""
        self.draining = True
        self.worker.drain(time.monotonic() + timeout_s)

    def shutdown(self) -> None:
        """Stop the worker, then close the engine (pending storage writes flushed); idempotent."""
        self.prep.shutdown(wait=False, cancel_futures=True)
        self.worker.stop()
        self.engine.close()

    async def api_error(self, _request: Request, exc: APIError) -> Response:
        self.metrics.count(exc.status)
        if exc.status == 499:  # nobody is left to read an answer
            return Response(status_code=499)
        headers = {"Retry-After": str(self._retry_after())} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def health(self) -> dict:
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="server_error", code="shutting_down")
        if not self.worker.alive:
            raise APIError(503, "the server's worker has stopped; see its log", type_="server_error")
        if self.engine.storage is None:
            return {"status": "ok"}
        # Off the loop: a backend that has been failing asks its server once.
        up = await asyncio.to_thread(self.engine.storage.backend.reachable)
        return {"status": "ok", "storage": "ok" if up else "unreachable"}

    async def version(self) -> dict:
        return {"version": __version__}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> dict:
        if model_id != self.model_name:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return self._card()

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvtier"}

    async def scrape(self) -> Response:
        # Off the loop: a storage backend's usage may ask its server.
        text = await asyncio.to_thread(self.metrics.exposition)
        return Response(text, media_type=CONTENT_TYPE)

    async def chat(self, request: Request):
        prompts, params = await self._admit(request, self._chat_prompt, chat=True)
        return await self._complete(request, prompts, params, chat=True)

    async def completions(self, request: Request):
        prompts, params = await self._admit(request, self._text_prompts, chat=False)
        return await self._complete(request, prompts, params, chat=False)

    async def _chat_prompt(self, body: dict) -> list[Prompt]:
        messages = api.chat_messages(body)
        if self.engine.chat_template is None:
            raise api.no_chat_template(self.model_name)
        try:
            return [Prompt(await self._off_loop(self.engine.encode_chat, messages))]
        except ConfigError as e:  # the template refused the messages (its raise_exception)
            raise APIError(400, str(e), param="messages") from None

    async def _text_prompts(self, body: dict) -> list[Prompt]:
        return await self._off_loop(self._encode, completion_prompts(body, self.engine.vocab_size))

    def _encode(self, prompts: list[str | list[int]]) -> list[Prompt]:
        """Each text prompt's ids, each prompt of ids' text (for `echo`); runs on `prep`."""
        encode, decode = self.engine.tokenizer.encode, self.engine.decode
        return [Prompt(encode(p), p) if isinstance(p, str) else Prompt(p, decode(p)) for p in prompts]

    async def _admit(
        self, request: Request, prompts_of: Callable[[dict], Awaitable[list[Prompt]]], chat: bool
    ) -> tuple[list[Prompt], RequestParams]:
        """Shutdown, size and queue checks (503, 413, 429), then the body read (within its deadline, else
        408), parsed and tokenised off the loop."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type_="server_error", code="shutting_down")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            raise api.too_large(self.limits.max_body_bytes)  # before a byte of the body is read
        queued = self.engine.num_waiting + self.worker.jobs.qsize() + self.admitting
        if queued >= self.limits.max_queue:
            raise APIError(
                429,
                f"the server is overloaded: {queued} requests are waiting (at most {self.limits.max_queue})",
                type_="rate_limit_exceeded",
                code="queue_full",
            )
        self.admitting += 1
        try:
            raw = await _read_body(request, self.limits.max_body_bytes, self.limits.body_timeout_s)
            body = await self._off_loop(api.parse_body, raw)
            api.check_model(body, self.model_name)
            params = request_params(body, chat, self.limits.request_timeout_s)
            return await prompts_of(body), params
        finally:
            self.admitting -= 1

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def _retry_after(self) -> int:
        """Seconds a refused client should wait: about one request's lifetime, 1 to 60."""
        mean = self.metrics.mean_latency_s()
        return 1 if mean is None else min(60, max(1, math.ceil(mean)))

    async def _complete(self, request: Request, prompts: list[Prompt], params: RequestParams, chat: bool):
        """Queue `n` jobs per prompt (choice `i * n + j`: prompt `i`, draw `j`), answer them as one.

        The choices of a prompt share its KV: the scheduler holds the later ones back until
        the first has computed the prompt, then they match it in the prefix cache.
        """
        self._check_fits(prompts, params, chat)
        if not self.worker.alive:
            raise APIError(503, "the server's worker has stopped; see its log", type_="server_error")
        loop = asyncio.get_running_loop()
        jobs = [Job(p.ids, params.choice(j), loop) for p in prompts for j in range(params.n)]
        for job in jobs:
            self.worker.jobs.put(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        reply = api.Reply(
            rid, int(time.time()), chat, self.model_name, self.engine.token_text, params.include_usage
        )
        prompt_tokens = sum(len(p.ids) for p in prompts)
        echoes = [p.text for p in prompts for _ in range(params.n)] if params.echo else []
        if params.stream:
            events = self._sse(jobs, reply, prompt_tokens, echoes, access_record(request.scope))
            return StreamingResponse(events, media_type="text/event-stream")
        results = await choices.drain(jobs, request)
        access_record(request.scope).update(usage_of(prompt_tokens, results))
        for result in results:
            self.metrics.observe(result)
        for result, job in zip(results, jobs, strict=True):
            if (error := api.unfinished_error(result, job.params)) is not None:
                raise error
        self.metrics.count(200)
        return await self._off_loop(reply.whole, results, prompt_tokens, echoes)

    def _check_fits(self, prompts: list[Prompt], params: RequestParams, chat: bool) -> None:
        """400 for more choices than a request may ask, or a prompt past the model's context."""
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x n={params.n} choices exceed the {MAX_CHOICES} a request may ask",
                param="n",
            )
        context, new = self.engine.max_context, params.sampling.max_tokens
        longest = max(len(p.ids) for p in prompts)
        if context and longest + new > context:
            raise APIError(
                400,
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{longest} and {new} more were requested",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )

    async def _sse(
        self, jobs: list[Job], reply: api.Reply, prompt_tokens: int, echoes: list[str], access: dict
    ) -> AsyncIterator[str]:
        """The server-sent events of one streamed request: each choice's role (chat) or echo,
        text deltas and finish; the usage where asked; `[DONE]`.

        A request one of whose choices fails or times out ends with an error event, then `[DONE]`.
        """
        streams = [api.ChoiceStream(self.engine.decode, job.params.stop) for job in jobs]
        results: list[RequestResult] = []
        error = None
        counted = False
        try:
            for i in range(len(jobs)):
                if reply.chat:
                    yield reply.chunk(i, {"delta": {"role": "assistant", "content": ""}})
                elif echoes and echoes[i]:
                    yield reply.delta(i, echoes[i])
            async with aclosing(choices.events(jobs)) as events:
                async for i, kind, value in events:
                    if kind == "token":
                        if delta := streams[i].push(value):
                            yield reply.delta(i, delta)
                        continue
                    if kind == "cancelled":  # its client is gone
                        return
                    if kind == "error":
                        error = api.failure_error(value)
                        break
                    if delta := streams[i].rest(value.text):
                        yield reply.delta(i, delta)
                    self.metrics.observe(value)
                    if (error := api.unfinished_error(value, jobs[i].params)) is not None:
                        break
                    results.append(value)
                    yield reply.finish(i, value.finish_reason)
            self.metrics.count(200 if error is None else error.status)
            counted = True
            if error is not None:
                yield f"data: {json.dumps(error.body())}\n\n"
            elif reply.include_usage:
                yield reply.usage_chunk(prompt_tokens, results)
            yield "data: [DONE]\n\n"
        finally:
            access.update(usage_of(prompt_tokens, results))
            if not counted:  # the client left mid-stream: the server stopped writing to it
                access["status"] = 499
                self.metrics.count(499)
                log.info("a client left its stream of %d choices; its requests are cancelled", len(jobs))
            for job in jobs:
                job.cancel.set()  # a client that went away stops the worker at its next token


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as more than `limit` bytes arrive (chunked bodies too), with
    408 when it has not wholly arrived within `timeout_s`, and with 499 when its client went away."""
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise api.too_large(limit)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
            type_="timeout_error",
            code="body_timeout",
        ) from None
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s disconnected mid-upload (%d bytes of its body came): request dropped", client, size)
        raise APIError(499, "the client disconnected during the upload", type_="cancelled") from None
    return b"".join(chunks)
