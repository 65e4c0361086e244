"""`TextCodec`, the engine's tokenizer side: EOS ids, stop strings, and what it does without a tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from served import tiny_tokenizer

from kvtier.engine.sampling import SamplingParams
from kvtier.engine.text import TextCodec
from kvtier.errors import ConfigError


def test_the_generation_configs_eos_ids_win_over_the_tokenizers() -> None:
    tokenizer = tiny_tokenizer()
    assert TextCodec(tokenizer, SimpleNamespace(eos_token_id=[7, 9])).eos == {7, 9}
    assert TextCodec(tokenizer, SimpleNamespace(eos_token_id=None)).eos == {tokenizer.eos_token_id}
    assert TextCodec(None, None).eos == frozenset()


def test_a_stop_string_is_found_across_tokens_and_cuts_nothing_without_a_tokenizer() -> None:
    tokenizer = tiny_tokenizer()
    text = TextCodec(tokenizer, None)
    params = SamplingParams(max_tokens=8, stop=["lazy dog"])
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    assert text.stopped(ids, params) and not text.stopped(ids[:-1], params)
    bare = TextCodec(None, None)
    assert not bare.stopped(ids, params) and bare.decode(ids) == "" and bare.chat_template is None
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        bare.chat_template = "{{ messages }}"
    with pytest.raises(ConfigError, match="no chat template"):
        bare.encode_chat([{"role": "user", "content": "hi"}])
