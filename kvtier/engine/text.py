"""The tokenizer's side of an engine: chat template, encoding and decoding, EOS and stop strings.

`TextCodec` is held by `Engine` (`engine.text`), which hands `chat_template`, `encode_chat`,
`decode` and `token_text` on to it; the model runner asks it for the EOS ids and whether a stop
string completed. It holds the tokenizer (None: no text, token ids only) and the model's
generation config (its EOS ids, read on first use). Every refusal is a `ConfigError`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.engine.sampling import SamplingParams, stop_index
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.engine.scheduler import Request


class TextCodec:
    """Text in and out of an engine; see the module docstring."""

    def __init__(self, tokenizer: Any | None, generation_config: Any | None) -> None:
        self.tokenizer = tokenizer
        self._generation_config = generation_config

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template (Jinja), None where it has none (then `encode_chat` refuses)."""
        return getattr(self.tokenizer, "chat_template", None) or None

    @chat_template.setter
    def chat_template(self, template: str) -> None:
        """Give the tokenizer `template`; `ConfigError` (nothing changed) where it is not valid Jinja."""
        from jinja2 import TemplateError, TemplateSyntaxError

        if self.tokenizer is None:
            raise ConfigError("a chat template needs a tokenizer: build the engine with one")
        try:  # compiled by the tokenizer's own renderer, its extensions included
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello"}], chat_template=template, tokenize=False
            )
        except TemplateSyntaxError as e:
            raise ConfigError(f"the chat template is not valid Jinja: line {e.lineno}: {e.message}") from None
        except TemplateError:
            pass  # it compiled; it may refuse this one message and still serve others
        self.tokenizer.chat_template = template

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the generation prompt appended, through the chat template.

        `ConfigError` where there is no template, or where the template refuses the messages
        (its `raise_exception`, such as roles that do not alternate).
        """
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise ConfigError(
                "this model's tokenizer has no chat template: give one (kvtier serve --chat-template FILE) "
                "or send text completions"
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True
            )
        except TemplateError as e:
            raise ConfigError(f"the chat template refused these messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens skipped ("" without a tokenizer)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True) if self.tokenizer else ""

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (for logprobs)."""
        return self.tokenizer.decode([token]) if self.tokenizer else ""

    @functools.cached_property
    def eos(self) -> frozenset[int]:
        """The token ids that end an answer: the generation config's, else the tokenizer's."""
        ids = getattr(self._generation_config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return frozenset()
        return frozenset(int(i) for i in (ids if isinstance(ids, list | tuple) else [ids]))

    def stopped(self, tokens: list[int], params: SamplingParams) -> bool:
        """Whether the last token completed a stop string (only the tail's text is decoded)."""
        if not params.stop or self.tokenizer is None:
            return False
        return stop_index(self.decode(tokens[-params.stop_window :]), params.stop) is not None

    def answer(self, req: Request) -> str:
        """The answer's text, cut just before its first stop string."""
        text = self.decode(req.tokens)
        cut = stop_index(text, req.params.stop) if self.tokenizer is not None else None
        return text if cut is None else text[:cut]
