"""The OpenAI-compatible app over an engine and its tiered cache (`create_app`).

One worker thread owns the engine and steps it while any request is in it (continuous
batching: new requests join at the next step); when none is left it settles the cache,
so write-through pages reach storage while the server idles (another server sharing the
store finds them). A client that disconnects (streaming or not) has its request
cancelled before the next step, which inserts what was computed, frees its slots and
releases its locks. Routes (`kvtier.server.routes`): `POST /v1/chat/completions` and
`/v1/completions` (both with `stream`), `GET /v1/models`, `/v1/models/{id}`, `/version`,
`/health` and `/metrics` (prometheus-client's text, `kvtier.server.metrics`). Every error
comes back in OpenAI's shape (`APIError.body`) with a 4xx or 5xx status, and the server
keeps serving: unknown routes and methods, validation and crashes included
(`kvtier.server.web`). With an API key, every route but `/health` and `/metrics` needs it
(401). A tokenizer without a chat template is warned about when the app is made; its chat
requests are answered 400 and text completions still work.

Lifetime: the app owns the engine. `app.state.drain(timeout_s)` starts a bounded shutdown:
new requests are answered 503 (and `/health` says so), what is running or queued keeps
running until the timeout, and what is left then is cancelled and answered 503 (a stream:
an error event, then `[DONE]`). The app's shutdown (uvicorn's lifespan end) stops the worker
and closes the engine, which flushes pending storage writes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvtier import __version__
from kvtier.engine.engine import Engine
from kvtier.errors import APIError, ConfigError
from kvtier.server.access import AccessLog
from kvtier.server.limits import Limits
from kvtier.server.metrics import ServerMetrics
from kvtier.server.routes import Routes
from kvtier.server.web import BearerAuth, openai_errors
from kvtier.server.worker import Worker

log = logging.getLogger(__name__)

# Routes that answer without the API key: probes and scrapers hold none.
OPEN_PATHS = ("/health", "/metrics")


def create_app(
    engine: Engine,
    model_name: str,
    *,
    max_queue: int = Limits.max_queue,
    max_body_bytes: int = Limits.max_body_bytes,
    request_timeout_s: float = Limits.request_timeout_s,
    body_timeout_s: float = Limits.body_timeout_s,
    api_key: str | None = None,
    access_log: bool = True,
) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name`; it closes `engine` at shutdown.

    `api_key`: requests but `OPEN_PATHS` need `Authorization: Bearer <api_key>` (None: none do).
    `access_log`: one line per request on the `kvtier.access` logger at INFO (`kvtier.server.access`).
    """
    # Refused before the worker starts.
    limits = Limits(max_queue, max_body_bytes, request_timeout_s, body_timeout_s)
    if api_key is not None and not api_key.strip():
        raise ConfigError("api_key is empty: give a key, or None for none")
    if engine.chat_template is None:
        log.warning(
            "the tokenizer of %r has no chat template: chat completions are answered 400 (text completions "
            "work); give one with --chat-template FILE",
            model_name,
        )
    routes = Routes(engine, model_name, Worker(engine), ServerMetrics(engine), limits)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        routes.shutdown()

    app = FastAPI(title="kvtier", version=__version__, lifespan=lifespan)
    app.state.worker, app.state.engine, app.state.metrics = routes.worker, engine, routes.metrics
    app.state.shutdown, app.state.drain = routes.shutdown, routes.drain
    app.add_exception_handler(APIError, routes.api_error)
    openai_errors(app, routes.metrics.count)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key, open_paths=OPEN_PATHS, count=routes.metrics.count)
    if access_log:  # outermost: it sees every answer, the API key's 401 included
        app.add_middleware(AccessLog)
    app.get("/health")(routes.health)
    app.get("/version")(routes.version)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)
    app.get("/metrics")(routes.scrape)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
    return app
