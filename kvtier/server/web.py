"""The server's HTTP edge, outside its routes: every refusal in OpenAI's error shape, the API
key, and the listening socket.

`openai_errors(app, count)` makes every answer that is not a route's own come back as
`{"error": {"message", "type", "param", "code"}}` (`APIError.body`): an unknown route
(404), a method a route does not take (405, with `Allow`), a request FastAPI's validation
refuses (400, never its 422 `{"detail": ...}`), and a crash inside a route (500; the
traceback goes to the log, the server keeps serving). `count(status)` sees each one.

`BearerAuth` (ASGI middleware): with a key, a request without `Authorization: Bearer KEY`
is answered 401 before any route runs; its `open_paths` (health and metrics, for probes
and scrapers) need none.

`listening_socket(host, port)`: bound before the model loads, so an address in use or not
this machine's is refused at once (`BindError`); uvicorn then serves on it.
"""

from __future__ import annotations

import errno
import hmac
import socket
from collections.abc import Callable, Collection

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier.errors import APIError, BindError
from kvtier.server import protocol as api


def openai_errors(app: FastAPI, count: Callable[[int], None]) -> None:
    """Answer unknown routes, wrong methods, validation errors and crashes of `app` in OpenAI's shape."""

    def answer(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        count(error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            return answer(api.not_found(method, path))
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return answer(api.method_not_allowed(method, path, allowed), {"Allow": allowed})
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return answer(APIError(exc.status_code, str(exc.detail), type_=kind), exc.headers)

    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(x) for x in first.get("loc", ())]
        param = where[-1] if where else None
        message = f"{' '.join(where) or 'the request'}: {first.get('msg', 'is not valid')}"
        return answer(APIError(400, message, param=param))

    async def crash(_request: Request, exc: Exception) -> JSONResponse:
        # Starlette raises `exc` again once this is sent: the server logs its traceback.
        return answer(APIError(500, f"the server failed on this request: {exc!r}", type_="server_error"))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, crash)


class BearerAuth:
    """ASGI middleware: requests outside `open_paths` need `Authorization: Bearer <key>`, else 401."""

    def __init__(
        self, app: ASGIApp, key: str, open_paths: Collection[str], count: Callable[[int], None]
    ) -> None:
        self.app, self.open_paths, self.count = app, frozenset(open_paths), count
        self.expected = f"bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.count(401)
        error = api.unauthorized()
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # The scheme is case-insensitive; the key is compared in constant time.
        return hmac.compare_digest(scheme.lower() + b" " + token.strip(), self.expected)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (not yet listening); `BindError` where it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise BindError(f"--host {host}: not an address to listen on ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        # Lets a restarted server take its port while old connections linger in TIME_WAIT;
        # a port another socket listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise BindError(_bind_refusal(host, port, e)) from None
    return sock


def _bind_refusal(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: the port is already in use on {host} (is another server running?)"
    if e.errno == errno.EACCES:
        return f"--port {port}: not permitted on {host} (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"
