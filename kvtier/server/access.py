"""The access log: one line per HTTP request, at INFO on the `kvtier.access` logger.

`AccessLog` (ASGI middleware, outermost) logs each request once its answer has been sent
(a stream: once it ended): the client, the method and path, the status, and for a
completion its prompt and generated tokens and its time to first token; then the time the
request took. The routes leave what only they know in the request's `access_record`
(`usage_of`: the tokens and TTFT of its choices; `status`: 499 for a stream its client
left, whose HTTP status was already 200). Example:

    127.0.0.1:51234 "POST /v1/chat/completions" 200 tokens 23+8 ttft 12 ms, 45 ms
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.engine.results import RequestResult

log = logging.getLogger("kvtier.access")

_KEY = "kvtier.access"


def access_record(scope: Scope) -> dict[str, Any]:
    """The dict a request's routes fill for its access line (kept in its ASGI scope)."""
    return scope.setdefault(_KEY, {})


def usage_of(prompt_tokens: int, results: Sequence[RequestResult]) -> dict[str, Any]:
    """A completion's part of its access line: prompt and generated tokens, the first choice's TTFT."""
    return {
        "prompt": prompt_tokens,
        "generated": sum(len(r.tokens) for r in results),
        "ttft_s": results[0].ttft_s if results else None,
    }


class AccessLog:
    """ASGI middleware: one `kvtier.access` line per HTTP request, once it has been answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(_line(scope, status, time.perf_counter() - start))


def _line(scope: Scope, status: int, took_s: float) -> str:
    record = scope.get(_KEY, {})
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    query = f"?{scope['query_string'].decode(errors='replace')}" if scope.get("query_string") else ""
    parts = [f'{who} "{scope["method"]} {scope["path"]}{query}" {record.get("status", status)}']
    if "prompt" in record:
        parts.append(f"tokens {record['prompt']}+{record['generated']}")
        if record["ttft_s"] is not None:
            parts.append(f"ttft {record['ttft_s'] * 1e3:.0f} ms,")
    parts.append(f"{took_s * 1e3:.0f} ms")
    return " ".join(parts)
