"""OpenAI's API shapes for `kvtier serve`: request bodies checked, response objects, errors.

Each check raises `APIError` (the status and OpenAI's `type`, `param`, `code`) before the
request reaches the engine: `parse_body` (a JSON object), `check_model`, `chat_messages` /
`text_prompt`, `sampling` (every range `SamplingParams` checks, with the API's `param`).
`Reply` builds the response objects and server-sent events of one request;
`failure_error` / `unfinished_error` say what a failed, timed-out or cancelled request is
answered with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.engine.results import RequestResult
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import APIError, ConfigError, PromptTooLongError


@dataclass(frozen=True)
class Reply:
    """What every response object of one request repeats: its id, creation time, kind and model."""

    rid: str
    created: int
    chat: bool
    model: str

    def whole(self, result: RequestResult) -> dict:
        """The non-streamed response object."""
        finish = result.finish_reason
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


def failure_error(error: BaseException) -> APIError:
    """The API's answer to a request that failed in the worker."""
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, ConfigError):
        return APIError(400, str(error))
    return APIError(500, f"generation failed: {error}", type_="server_error")


def unfinished_error(result: RequestResult, params: SamplingParams) -> APIError | None:
    """The error a request that ended without finishing is answered with; None where it finished."""
    if result.finish_reason == "timeout":
        return APIError(
            504,
            f"the request timed out after {params.timeout_s:g} s ({len(result.tokens)} tokens generated)",
            type_="timeout_error",
            code="request_timeout",
        )
    if result.finish_reason == "cancelled":
        return APIError(499, "request cancelled", type_="cancelled")
    return None


def too_large(limit: int) -> APIError:
    """The answer to a body over `limit` bytes."""
    return APIError(
        413, f"the request body exceeds the server's limit of {limit} bytes", code="request_too_large"
    )


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; 400 for anything else (runs off the event loop)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict, model_name: str) -> None:
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


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The chat's `{role, content}` messages, nothing else of each kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def text_prompt(body: dict) -> str:
    text = body.get("prompt")
    if not isinstance(text, str) or not text:
        raise APIError(400, "prompt must be a non-empty string", param="prompt")
    return text


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def sampling(body: dict, timeout_s: float) -> SamplingParams:
    """The body's sampling fields, each range checked with its `param`; `timeout_s` is the server's."""

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
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=tuple(stop),
        seed=seed,
        timeout_s=timeout_s,
    )


class TextStream:
    """The text deltas of a growing answer, decoding a few tokens per token (not the whole answer).

    Each delta is the text a new token adds after the tokens before it, decoded over a
    short window (so a tokenizer that drops a leading space at the start of a decode still
    gives the space); a token that ends inside a multi-byte character waits for the next.
    `rest(text)`: what of the whole answer's text was not sent yet.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix = self.read = 0
        self.sent = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix : self.read])
        text = self.decode(self.tokens[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        delta = text[len(before) :]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        return text[len(self.sent) :] if text.startswith(self.sent) else ""
