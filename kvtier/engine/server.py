"""`kvtier serve`: an OpenAI-compatible HTTP API over the engine and its tiered cache.

One worker thread owns the model and the GPU; requests queue in arrival order and
run one at a time (the engine's structure leaves room for batching later). A
streaming client that disconnects is noticed at the next token: the worker closes
the request, which inserts what was computed and releases its locks.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text: cache hits and
tokens per tier, bytes moved, evictions, fragmentation, request latencies). Errors
come back in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with
a 4xx status, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvtier.engine.engine import Engine, PromptTooLongError, RequestResult, SamplingParams

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error to return in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


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
    """The thread that owns the engine: runs jobs one at a time, in arrival order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cancelled = 0  # requests stopped because their client went away
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="kvtier-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():
                continue
            try:
                stream = self.engine.stream(job.prompt, job.params)
                while True:
                    if job.cancel.is_set():
                        stream.close()  # inserts what was computed, frees the rest, releases the lease
                        self.cancelled += 1
                        job.emit("cancelled", None)
                        break
                    try:
                        token = next(stream)
                    except StopIteration as done:
                        job.emit("done", done.value)
                        break
                    job.emit("token", token)
            except Exception as e:  # the request fails; the worker keeps serving
                log.exception("request failed")
                job.emit("error", e)


@dataclass
class Stats:
    """Request counters and latency sums for /metrics."""

    requests: dict[str, int] = field(default_factory=dict)
    ttft_sum: float = 0.0
    ttft_count: int = 0
    latency_sum: float = 0.0
    latency_count: int = 0

    def count(self, status: str) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name`."""
    app = FastAPI(title="kvtier")
    worker = Worker(engine)
    stats = Stats()
    app.state.worker, app.state.engine, app.state.stats = worker, engine, stats

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        stats.count(str(exc.status))
        return exc.response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvtier"}],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_prometheus(engine, stats), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        _check_model(body, model_name)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
            raise APIError(
                400, "messages must be a non-empty list of {role, content} objects", param="messages"
            )
        prompt = engine.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        return await _complete(request, body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        _check_model(body, model_name)
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise APIError(400, "prompt must be a non-empty string", param="prompt")
        prompt = engine.tokenizer.encode(text)
        return await _complete(request, body, prompt, chat=False)

    async def _complete(request: Request, body: dict, prompt: list[int], chat: bool):
        params = _sampling(body)
        if engine.max_context and len(prompt) + params.max_tokens > engine.max_context:
            raise APIError(
                400,
                f"this model's maximum context length is {engine.max_context} tokens; the prompt has "
                f"{len(prompt)} and {params.max_tokens} more were requested",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        job = Job(prompt, params, asyncio.get_running_loop())
        worker.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(
                _sse(request, job, rid, created, model_name, chat), media_type="text/event-stream"
            )
        tokens: list[int] = []
        result = await _drain(job, tokens)
        stats.count("200")
        _record(stats, result)
        finish = _finish_reason(result, params)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(result.tokens),
            "total_tokens": len(prompt) + len(result.tokens),
        }
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": usage,
        }

    async def _sse(request, job: Job, rid: str, created: int, model: str, chat: bool) -> AsyncIterator[str]:
        tokens: list[int] = []
        sent = ""
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                yield _chunk(rid, obj, created, model, {"delta": {"role": "assistant", "content": ""}})
            while True:
                kind, value = await job.events.get()
                if kind == "token":
                    tokens.append(value)
                    text = engine.decode(tokens)
                    delta, sent = text[len(sent) :], text
                    if delta:
                        payload = {"delta": {"content": delta}} if chat else {"text": delta}
                        yield _chunk(rid, obj, created, model, payload)
                elif kind == "done":
                    stats.count("200")
                    _record(stats, value)
                    end = {"delta": {}} if chat else {"text": ""}
                    end["finish_reason"] = _finish_reason(value, job.params)
                    yield _chunk(rid, obj, created, model, end)
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "error":
                    stats.count("500")
                    err = {
                        "error": {"message": str(value), "type": "server_error", "param": None, "code": None}
                    }
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                else:
                    return
        finally:
            job.cancel.set()  # a client that went away stops the worker at its next token

    return app


async def _drain(job: Job, tokens: list[int]) -> RequestResult:
    while True:
        kind, value = await job.events.get()
        if kind == "token":
            tokens.append(value)
        elif kind == "done":
            return value
        elif kind == "error":
            if isinstance(value, PromptTooLongError):
                raise APIError(400, str(value), code="context_length_exceeded")
            raise APIError(500, f"generation failed: {value}", type_="server_error")
        else:
            raise APIError(499, "request cancelled", type_="cancelled")


def _chunk(rid: str, obj: str, created: int, model: str, choice: dict) -> str:
    payload = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [{"index": 0, **choice}],
    }
    if "finish_reason" not in payload["choices"][0]:
        payload["choices"][0]["finish_reason"] = None
    return f"data: {json.dumps(payload)}\n\n"


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
        value = body.get(name, default)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and value != int(value))
        ):
            raise APIError(400, f"{name} must be a {'integer' if kind is int else 'number'}", param=name)
        return kind(value)

    max_tokens = number("max_completion_tokens", None, int)
    if max_tokens is None:
        max_tokens = number("max_tokens", 64, int)
    temperature = number("temperature", 1.0)
    top_p = number("top_p", 1.0)
    seed = number("seed", None, int)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed)


def _finish_reason(result: RequestResult, params: SamplingParams) -> str:
    return "length" if len(result.tokens) >= params.max_tokens else "stop"


def _record(stats: Stats, result: RequestResult) -> None:
    stats.ttft_sum += result.ttft_s
    stats.ttft_count += 1
    stats.latency_sum += result.total_s
    stats.latency_count += 1


def _prometheus(engine: Engine, stats: Stats) -> str:
    m = engine.cache.metrics
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP kvtier_{name} {help_}")
        lines.append(f"# TYPE kvtier_{name} {kind}")
        for labels, value in samples:
            lines.append(f"kvtier_{name}{labels} {value}")

    metric("cache_matches_total", "counter", "prefix lookups", [("", m.matches)])
    metric(
        "cache_prompt_tokens_total",
        "counter",
        "prompt tokens by where they were found",
        [
            ('{tier="device"}', m.device_hit_tokens),
            ('{tier="host"}', m.host_hit_tokens),
            ('{tier="none"}', m.miss_tokens),
        ],
    )
    metric(
        "cache_bytes_total",
        "counter",
        "KV bytes moved between tiers",
        [('{direction="h2d"}', m.bytes_h2d), ('{direction="d2h"}', m.bytes_d2h)],
    )
    metric("cache_loads_total", "counter", "load backs submitted", [("", m.loads)])
    metric(
        "cache_loaded_tokens_total", "counter", "tokens loaded back from the host", [("", m.loaded_tokens)]
    )
    load_s = sum(m.load_s)
    metric("cache_load_seconds_sum", "counter", "time from load submission to completion", [("", load_s)])
    gbps = (m.bytes_h2d / load_s / 1e9) if load_s else 0.0
    metric("cache_reload_gbps", "gauge", "reload speed over all loads", [("", gbps)])
    metric(
        "cache_evictions_total",
        "counter",
        "nodes evicted",
        [('{tier="device"}', m.device_evictions), ('{tier="host"}', m.host_evictions)],
    )
    metric("cache_backups_total", "counter", "device to host backups started", [("", m.backups)])
    frag = engine.cache.fragmentation()
    metric(
        "cache_free_slots",
        "gauge",
        "free slots per tier",
        [('{tier="device"}', frag["device_free_slots"]), ('{tier="host"}', frag["host_free_slots"])],
    )
    metric(
        "cache_free_runs",
        "gauge",
        "free extents per tier (fragmentation)",
        [('{tier="device"}', frag["device_free_runs"]), ('{tier="host"}', frag["host_free_runs"])],
    )
    metric(
        "cache_largest_free_run",
        "gauge",
        "largest free extent per tier",
        [
            ('{tier="device"}', frag["device_largest_free_run"]),
            ('{tier="host"}', frag["host_largest_free_run"]),
        ],
    )
    metric(
        "requests_total",
        "counter",
        "HTTP requests by status",
        [(f'{{status="{k}"}}', v) for k, v in sorted(stats.requests.items())] or [('{status="200"}', 0)],
    )
    metric("time_to_first_token_seconds_sum", "counter", "sum of TTFT", [("", stats.ttft_sum)])
    metric("time_to_first_token_seconds_count", "counter", "requests with a TTFT", [("", stats.ttft_count)])
    metric("request_seconds_sum", "counter", "sum of request latency", [("", stats.latency_sum)])
    metric("request_seconds_count", "counter", "completed requests", [("", stats.latency_count)])
    return "\n".join(lines) + "\n"
