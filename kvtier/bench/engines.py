"""What the engine benchmarks (multiturn, batching) share: their model, and stepping an engine to the end.

The model is a checkpoint, the default SmolLM2, or a random-weight shape.

`--shape llama-3.1-8b` is a Llama with the real Llama-3.1-8B shape (hidden 4096, 32 layers,
32 query heads and 8 KV heads of 128, MLP 14336, vocab 128256: 128 KiB of bf16 KV per
token) and random weights: the real compute and the real KV bytes, no checkpoint to fetch.
It is built with the target device and dtype as torch's defaults, so its weights are made
where they run and no full-precision CPU copy is ever allocated. `--shape tiny` is a
2-layer GQA Llama for CPU tests. Random weights answer random tokens: the benchmarks ask
for `ignore_eos`, so every answer is as long as asked.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    from kvtier.engine import Engine, RequestResult, SamplingParams, Update

SHAPES = ("tiny", "llama-3.1-8b")


def shape_config(shape: str) -> Any:
    """The `transformers.LlamaConfig` of a shape (see the module docstring)."""
    import transformers

    if shape == "llama-3.1-8b":
        return transformers.LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        )
    if shape == "tiny":
        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8192,
        )
    raise ConfigError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


@contextmanager
def _defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """torch's default device and dtype set to these for the block, restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(before)


def build_shape(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight `LlamaForCausalLM` of `shape`, made on `device` in `dtype`, in eval mode."""
    import transformers

    cfg = shape_config(shape)
    torch.manual_seed(seed)
    with _defaults(device, dtype), torch.no_grad():
        model = transformers.LlamaForCausalLM(cfg)
    return model.eval()


def bench_model(model_path: str | None, shape: str | None, device: torch.device, dtype: str | torch.dtype):
    """`(model, tokenizer, name)`: the shape's random model, else the checkpoint (default SmolLM2).

    `dtype`: a torch dtype, or a name `kvtier.engine.models.model_dtype` takes (`auto`, ...).
    """
    from kvtier.engine.models import DEFAULT_MODEL, load_model, model_dtype

    if shape is not None and model_path is not None:
        raise ConfigError(f"give a model or a shape, not both (got {model_path!r} and {shape!r})")
    dtype = model_dtype(dtype, device)
    if shape is not None:
        return build_shape(shape, device, dtype), None, f"{shape} (random weights)"
    model, tokenizer = load_model(model_path, device, dtype)
    return model, tokenizer, model_path or DEFAULT_MODEL


def vocab_size(model: Any) -> int:
    """Token ids the benchmarks draw from: `[0, vocab)` of the model's embedding."""
    return int(model.get_input_embeddings().num_embeddings)


def context_of(model: Any) -> int:
    """The model's context in tokens (0: no limit stated)."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 0)


def step(eng: Engine) -> list[Update]:
    """One `eng.step()`; a request that failed in it raises its error (a benchmark cannot go on)."""
    updates = eng.step()
    for update in updates:
        if update.error is not None:
            raise update.error
    return updates


def drain(eng: Engine) -> dict[int, RequestResult]:
    """Step `eng` until nothing runs or waits; the result of each request that finished, by id."""
    done = {}
    while eng.busy:
        for update in step(eng):
            if update.result is not None:
                done[update.request.id] = update.result
    return done


def run_alone(eng: Engine, prompt: Sequence[int], params: SamplingParams) -> RequestResult:
    """Submit one request to an idle engine and step it to the end; its result."""
    if eng.busy:
        raise InvariantError(
            f"run_alone needs an idle engine: {eng.num_running} running, {eng.num_waiting} waiting"
        )
    req = eng.submit(list(prompt), params)
    return drain(eng)[req.id]
