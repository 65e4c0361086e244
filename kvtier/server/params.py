"""An OpenAI request's parameters: which fields the server honours, ignores or refuses, parsed once.

`request_params(body, chat, timeout_s)` reads every field of a chat or a text completion
body except the prompt (`chat_messages`, `completion_prompts`) into `RequestParams`, or
raises `APIError` 400 with `param` naming the field, for

- a field OpenAI's API does not have (OpenAI answers the same);
- a field of OpenAI's that the server does not implement, given anything but its no-op
  value (`logit_bias`, `tools`, `response_format` other than text, `best_of` other than
  `n`, ...): nothing a client asks for is silently dropped;
- a value of the wrong type or out of its range, and combinations the server does not
  serve (`echo` or `stream` with `logprobs`).

Fields that change nothing the server does are accepted and ignored (`IGNORED`), and so
is `stream_options` without `stream`. Choice `j` of a request with `n` > 1 and a `seed`
samples with `seed + j` (as vLLM does): the choices differ and the request stays
reproducible.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvtier.engine.sampling import MAX_LOGPROBS, SamplingParams
from kvtier.errors import APIError
from kvtier.server.protocol import text_prompt

# Choices one request may ask for (`n` times the prompts of a text completion), OpenAI's bound for `n`.
MAX_CHOICES = 128
# Fields of both endpoints that change nothing here.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "parallel_tool_calls",
    }
)
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "max_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
    }
)
SUPPORTED = {
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
    False: _COMMON | {"prompt", "echo", "best_of"},
}
# OpenAI's fields the server does not implement, with the values that ask for nothing (null too).
UNSUPPORTED: dict[bool, dict[str, tuple[Any, ...]]] = {
    True: {
        "logit_bias": ({},),
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "response_format": ({"type": "text"},),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
    },
    False: {"logit_bias": ({},), "suffix": ("",)},
}
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids and, for `echo`, its text."""

    ids: list[int]
    text: str = ""


@dataclass(frozen=True)
class RequestParams:
    """What a request asks for besides its prompt: how to sample, how many choices, how to answer.

    `include_usage`: a streamed answer ends with a chunk carrying `usage` (`stream_options`).
    `echo`: a text completion's answer starts with its prompt.
    """

    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False

    def choice(self, j: int) -> SamplingParams:
        """The sampling of choice `j` of a prompt (`seed + j` where a seed is given)."""
        if j == 0 or self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + j)


def request_params(body: dict, chat: bool, timeout_s: float) -> RequestParams:
    """The body's parameters (see the module docstring); `timeout_s` is the server's."""
    _check_fields(body, chat)
    stream = _flag(body, "stream")
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    if not chat and _number(body, "best_of", n, int) != n:
        raise APIError(400, f"best_of must equal n ({n}): choices are not ranked here", param="best_of")
    logprobs = _logprobs(body, chat)
    echo = not chat and _flag(body, "echo")
    if logprobs is not None and echo:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    if logprobs is not None and stream:
        raise APIError(400, "logprobs are not supported with stream", param="logprobs")
    return RequestParams(
        _sampling(body, timeout_s, logprobs),
        n=n,
        stream=stream,
        include_usage=stream and _include_usage(body),
        echo=echo,
    )


def completion_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """A text completion's prompts: a string, a list of strings, of token ids, or of lists of ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [text_prompt(body)]
    if _is_ids(prompt):
        prompt = [prompt]
    ok = isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    if not ok or any(not p for p in prompt):
        raise APIError(
            400,
            "prompt must be a non-empty string, a list of them, a list of token ids or a list of such lists",
            param="prompt",
        )
    for p in prompt:
        bad = [t for t in p if not 0 <= t < vocab_size] if isinstance(p, list) else []
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    return prompt


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _check_fields(body: dict, chat: bool) -> None:
    """400 naming the first field that is not OpenAI's, or asks for what the server does not do."""
    supported, unsupported = SUPPORTED[chat], UNSUPPORTED[chat]
    route = "chat completions" if chat else "completions"
    for name, value in body.items():
        if name in supported or name in IGNORED:
            continue
        if name not in unsupported:
            raise APIError(400, f"unrecognized request argument for {route}: {name!r}", param=name)
        if value is not None and value not in unsupported[name]:
            raise APIError(400, f"{name} is not supported by this server, got {value!r}", param=name)


def _number(body: dict, name: str, default: Any, kind: type = float) -> Any:
    """`body[name]` as a `kind` (int or float), `default` when absent or null; 400 for anything else."""
    v = body.get(name)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or (kind is int and v != int(v))
    ):
        raise APIError(
            400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name
        )
    return kind(v)


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise APIError(400, f"{name} must be a boolean, got {v!r}", param=name)
    return bool(v)


def _in_range(name: str, v: float, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise APIError(400, f"{name} must be in [{lo}, {hi}], got {v:g}", param=name)


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives to record per token (`SamplingParams.logprobs`): None records nothing."""
    if not chat:
        k = _number(body, "logprobs", None, int)
        if k is not None:
            _in_range("logprobs", k, 0, MAX_LOGPROBS)
        return k
    top = _number(body, "top_logprobs", None, int)
    if top is not None:
        _in_range("top_logprobs", top, 0, MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return top or 0


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise APIError(
            400, f"stream_options may hold include_usage only, got {options!r}", param="stream_options"
        )
    return _flag(options, "include_usage")


def _sampling(body: dict, timeout_s: float, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields, each range `SamplingParams` checks checked first with its `param`."""
    max_tokens = _number(body, "max_completion_tokens", None, int)
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 64, int)
    if max_tokens < 1:
        raise APIError(400, f"{name} must be at least 1, got {max_tokens}", param=name)
    temperature = _number(body, "temperature", 1.0)
    _in_range("temperature", temperature, 0, 2)
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p:g}", param="top_p")
    presence, frequency = _number(body, "presence_penalty", 0.0), _number(body, "frequency_penalty", 0.0)
    _in_range("presence_penalty", presence, -2, 2)
    _in_range("frequency_penalty", frequency, -2, 2)
    seed = _number(body, "seed", None, int)
    if seed is not None:
        _in_range("seed", seed, *_INT64)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of at most 4 of them", param="stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=tuple(stop),
        seed=seed,
        timeout_s=timeout_s,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=logprobs,
    )
