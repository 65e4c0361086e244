"""`kvtier serve`: an OpenAI-compatible HTTP API over the engine and its tiered cache.

One worker thread owns the engine and steps it while any request is in it (continuous
batching: new requests join at the next step); when none is left it settles the cache,
so write-through pages reach storage while the server idles (another server sharing the
store finds them). A client that disconnects (streaming or not) has its request
cancelled before the next step, which inserts what was computed, frees its slots and
releases its locks. Routes: `POST /v1/chat/completions`
and `/v1/completions` (both with `stream`), `GET /v1/models`, `/health` and `/metrics`
(Prometheus text with fixed-bucket histograms: a scrape costs the same however long the
server has run; the storage tier's families only where the engine has one). Errors come
back in OpenAI's shape (`APIError.body`) with a 4xx status, and the server keeps serving.

Lifetime: the app owns the engine. Its shutdown (uvicorn's, on SIGTERM or Ctrl-C, once the
requests in flight are answered) stops the worker and closes the engine, which flushes
pending storage writes; `kvtier serve` then exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import threading
import time
import uuid
from argparse import Namespace
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvtier.alloc import AllocPolicy
from kvtier.cache import CacheConfig, WritePolicy
from kvtier.cache.storage_mover import HostStorageMover
from kvtier.engine.engine import Engine, RequestResult, SamplingParams
from kvtier.engine.models import DEFAULT_MODEL
from kvtier.engine.prometheus import Stats, exposition
from kvtier.engine.scheduler import Request as EngineRequest
from kvtier.errors import APIError, ConfigError, PromptTooLongError

log = logging.getLogger(__name__)

# How long the worker waits for another request before it settles the cache's transfers.
IDLE_S = 0.05
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.2


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
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self._active: dict[EngineRequest, Job] = {}
        self.thread = threading.Thread(target=self._run, name="kvtier-worker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _next(self) -> Job | None:
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
                self.engine.cache.settle()
            except Exception:
                log.exception("settling the cache between requests failed")
        return self.jobs.get()

    def _run(self) -> None:
        running = True
        while running:
            if not self.engine.busy:
                job = self._next()
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
            if running and self.engine.busy:
                self._step()
        for req, job in list(self._active.items()):  # stopping: what runs is cancelled
            self.engine.cancel(req)
            job.emit("cancelled", None)
        self._active.clear()

    def _submit(self, job: Job) -> None:
        if job.cancel.is_set():
            return
        try:
            self._active[self.engine.submit(job.prompt, job.params)] = job
        except (PromptTooLongError, ConfigError) as e:  # refused: the client's to fix
            log.info("request refused: %s", e)
            job.emit("error", e)
        except Exception as e:
            log.exception("submitting a request failed")
            job.emit("error", e)

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


class _Terminated(Exception):
    """SIGTERM, raised in the main thread once uvicorn has shut down and re-raised the signal."""


def _terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated


def command(args: Namespace) -> int:
    """`kvtier serve`: load the model, build the engine, serve until SIGTERM or Ctrl-C; 0 then."""
    import uvicorn

    from kvtier.commands import console, engine_for, storage_config

    config = CacheConfig(
        write_policy=WritePolicy(args.write_policy), host_alloc_policy=AllocPolicy(args.host_alloc)
    )
    storage = storage_config(args)
    dev, engine = engine_for(args, "loading the model", config, host_layout=args.host_layout, storage=storage)
    name = args.model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    tier = f", storage on {engine.storage.backend.describe()}" if engine.storage is not None else ""
    console.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({dev}{tier})")
    app = create_app(engine, name)
    # uvicorn handles SIGTERM and SIGINT itself (a graceful shutdown, the app's included),
    # then raises the signal again for the handler it found: this one, and Python's for SIGINT.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.state.shutdown()  # done by the app's shutdown already, unless uvicorn never started
    console.print(f"stopped; {_stored(engine.storage)}" if engine.storage is not None else "stopped")
    return 0


def _stored(storage: HostStorageMover) -> str:
    m = storage.metrics.snapshot()
    return f"{m['pages_written']} pages ({m['bytes_written'] / 1e6:.1f} MB) written to storage"


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name`; it closes `engine` at shutdown."""
    api = Routes(engine, model_name, Worker(engine), Stats())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        api.shutdown()

    app = FastAPI(title="kvtier", lifespan=lifespan)
    app.state.worker, app.state.engine, app.state.stats = api.worker, engine, api.stats
    app.state.shutdown = api.shutdown
    app.add_exception_handler(APIError, api.api_error)
    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)
    app.get("/metrics")(api.metrics)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    return app


@dataclass
class Routes:
    """The routes: each request is checked here, then queued for the worker."""

    engine: Engine
    model_name: str
    worker: Worker
    stats: Stats

    def shutdown(self) -> None:
        """Stop the worker, then close the engine (pending storage writes flushed); idempotent."""
        self.worker.stop()
        self.engine.close()

    async def api_error(self, _request: Request, exc: APIError) -> JSONResponse:
        self.stats.count(str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvtier"}
        return {"object": "list", "data": [card]}

    async def metrics(self) -> PlainTextResponse:
        text = exposition(self.engine, self.stats)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request):
        body = await _json(request)
        _check_model(body, self.model_name)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
            raise APIError(
                400, "messages must be a non-empty list of {role, content} objects", param="messages"
            )
        prompt = self.engine.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        return await self._complete(request, body, prompt, chat=True)

    async def completions(self, request: Request):
        body = await _json(request)
        _check_model(body, self.model_name)
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise APIError(400, "prompt must be a non-empty string", param="prompt")
        return await self._complete(request, body, self.engine.tokenizer.encode(text), chat=False)

    async def _complete(self, request: Request, body: dict, prompt: list[int], chat: bool):
        params = _sampling(body)
        context = self.engine.max_context
        if context and len(prompt) + params.max_tokens > context:
            raise APIError(
                400,
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(prompt)} and {params.max_tokens} more were requested",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        job = Job(prompt, params, asyncio.get_running_loop())
        self.worker.jobs.put(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        reply = _Reply(rid, int(time.time()), chat, self.model_name)
        if body.get("stream"):
            return StreamingResponse(self._sse(job, reply), media_type="text/event-stream")
        result = await _drain(job, request)
        self.stats.record(result)
        return reply.whole(result, _finish_reason(result, params))

    async def _sse(self, job: Job, reply: _Reply) -> AsyncIterator[str]:
        """The server-sent events of one streamed request: role, text deltas, finish, `[DONE]`."""
        tokens: list[int] = []
        sent = ""
        try:
            if reply.chat:
                yield reply.chunk({"delta": {"role": "assistant", "content": ""}})
            kind, value = await job.events.get()
            while kind == "token":
                tokens.append(value)
                text = self.engine.decode(tokens)
                delta, sent = text[len(sent) :], text
                if delta:
                    yield reply.chunk({"delta": {"content": delta}} if reply.chat else {"text": delta})
                kind, value = await job.events.get()
            if kind == "done":
                self.stats.record(value)
                end = {"delta": {}} if reply.chat else {"text": ""}
                end["finish_reason"] = _finish_reason(value, job.params)
                yield reply.chunk(end)
                yield "data: [DONE]\n\n"
            elif kind == "error":
                error = _api_error(value)
                self.stats.count(str(error.status))
                yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            job.cancel.set()  # a client that went away stops the worker at its next token


@dataclass(frozen=True)
class _Reply:
    """What every response object of one request repeats: its id, creation time, kind and model."""

    rid: str
    created: int
    chat: bool
    model: str

    def whole(self, result: RequestResult, finish: str) -> dict:
        """The non-streamed response object."""
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None}
        n, k = result.prompt_tokens, len(result.tokens)
        usage = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
        return {**self._object("chat.completion", [choice]), "usage": usage}

    def chunk(self, choice: dict) -> str:
        """One server-sent event of a streamed response."""
        payload = self._object("chat.completion.chunk", [{"index": 0, "finish_reason": None, **choice}])
        return f"data: {json.dumps(payload)}\n\n"

    def _object(self, chat_kind: str, choices: list[dict]) -> dict:
        kind = chat_kind if self.chat else "text_completion"
        return {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def _api_error(error: BaseException) -> APIError:
    """The API's answer to a request that failed in the worker."""
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, ConfigError):
        return APIError(400, str(error))
    return APIError(500, f"generation failed: {error}", type_="server_error")


async def _drain(job: Job, request: Request) -> RequestResult:
    """The result of a non-streamed job; a client that goes away meanwhile cancels it."""
    watch = asyncio.create_task(_cancel_when_gone(job, request))
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise _api_error(value)
            if kind == "cancelled":
                raise APIError(499, "request cancelled", type_="cancelled")
    finally:
        watch.cancel()


async def _cancel_when_gone(job: Job, request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel.set()


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(400, "you must provide a model parameter", param="model")
    if model != model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server has {model_name!r}",
            param="model",
            code="model_not_found",
        )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _sampling(body: dict) -> SamplingParams:
    def number(name: str, default, kind=float):
        v = body.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and v != int(v)):
            raise APIError(400, f"{name} must be a {'integer' if kind is int else 'number'}", param=name)
        return kind(v)

    max_tokens = number("max_completion_tokens", None, int)
    if max_tokens is None:
        max_tokens = number("max_tokens", 64, int)
    temperature = number("temperature", 1.0)
    top_p = number("top_p", 1.0)
    seed = number("seed", None, int)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    # Every range SamplingParams checks was checked above, with the API's `param`.
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop), seed=seed
    )


def _finish_reason(result: RequestResult, params: SamplingParams) -> str:
    return "length" if len(result.tokens) >= params.max_tokens else "stop"
