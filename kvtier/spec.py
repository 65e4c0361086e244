"""KV specs: which per-token buffers a model keeps, their shapes, dtypes and layers.

A `KVSpec` is a frozen value. It owns no memory; pools are built from it. Each
`BufferSpec` describes one buffer kind (K, V, MLA latent, DSA indexer, any
per-token sidecar) as a row per token, present on a subset of the model's layers.

Invariants:
- buffer names are unique; every buffer has at least one layer, in ascending
  order, each in `[0, num_layers)`;
- a row is at least one byte; `page_size` >= 1;
- every layer of the model carries at least one buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property

import torch

from kvtier.errors import SpecError

# The DSA indexer row: a 128-byte fp8 index key then its fp32 scale, as raw bytes.
INDEXER_ROW_BYTES = 128 + 4

# Packed fp8 MLA row: 512 fp8 latent values, four fp32 scales (one per 128 values),
# then the 64 rotary values kept in bf16.
PACKED_FP8_MLA_ROW_BYTES = 512 + 4 * 4 + 64 * 2

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8, torch.float32)


class BufferKind(str, Enum):
    """What a buffer holds for each token."""

    K = "k"
    V = "v"
    MLA_LATENT = "mla_latent"
    INDEXER = "indexer"
    SIDECAR = "sidecar"


@dataclass(frozen=True)
class BufferSpec:
    """One per-token buffer: a row of `row_shape` elements of `dtype` on `layers`."""

    name: str
    kind: BufferKind
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("a buffer needs a name")
        if self.dtype not in SUPPORTED_DTYPES:
            raise SpecError(f"buffer {self.name!r}: dtype {self.dtype} is not one of {SUPPORTED_DTYPES}")
        if not self.row_shape or any(d <= 0 for d in self.row_shape):
            raise SpecError(f"buffer {self.name!r}: row shape {self.row_shape} must be positive")
        if not self.layers:
            raise SpecError(f"buffer {self.name!r} has no layers")
        if list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise SpecError(f"buffer {self.name!r}: layers {self.layers} must be ascending, distinct, >= 0")

    @cached_property  # hot (every page view, every plan): computed once
    def row_bytes(self) -> int:
        """Bytes of one token's row on one layer."""
        return math.prod(self.row_shape) * self.dtype.itemsize

    def bytes_per_token(self) -> int:
        """Bytes of one token over all the layers that carry this buffer."""
        return self.row_bytes * len(self.layers)

    def local_layer(self, layer: int) -> int:
        """Position of model layer `layer` among this buffer's layers."""
        try:
            return self._layer_index[layer]
        except KeyError:
            raise SpecError(f"buffer {self.name!r} has no layer {layer}; it has {self.layers}") from None

    @cached_property  # writes the instance's __dict__, which a frozen dataclass allows
    def _layer_index(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.layers)}


@dataclass(frozen=True)
class KVSpec:
    """The KV buffers of a model: `buffers` over `num_layers` layers, paged by `page_size`."""

    name: str
    num_layers: int
    buffers: tuple[BufferSpec, ...]
    page_size: int = 1

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise SpecError(f"spec {self.name!r}: num_layers {self.num_layers} must be positive")
        if self.page_size <= 0:
            raise SpecError(f"spec {self.name!r}: page_size {self.page_size} must be positive")
        names = [b.name for b in self.buffers]
        if not names or len(set(names)) != len(names):
            raise SpecError(f"spec {self.name!r}: buffer names {names} must be non-empty and unique")
        covered: set[int] = set()
        for b in self.buffers:
            if b.layers[-1] >= self.num_layers:
                raise SpecError(
                    f"spec {self.name!r}: buffer {b.name!r} names layer {b.layers[-1]} "
                    f"but the model has {self.num_layers} layers"
                )
            covered.update(b.layers)
        missing = sorted(set(range(self.num_layers)) - covered)
        if missing:
            raise SpecError(f"spec {self.name!r}: layers {missing[:8]} carry no buffer")

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise SpecError(f"spec {self.name!r} has no buffer {name!r}; it has {[b.name for b in self.buffers]}")

    def buffers_on(self, layer: int) -> tuple[BufferSpec, ...]:
        """The buffers that model layer `layer` carries."""
        if not 0 <= layer < self.num_layers:
            raise SpecError(f"spec {self.name!r}: layer {layer} is outside [0, {self.num_layers})")
        return tuple(b for b in self.buffers if layer in b._layer_index)

    @property
    def widest_row_bytes(self) -> int:
        """Bytes of the widest buffer's row (what a kernel unit is sized by)."""
        return max(b.row_bytes for b in self.buffers)

    def bytes_per_token(self, buffer: str | None = None) -> int:
        """Bytes of one token over all layers: of one buffer, or of all buffers."""
        if buffer is not None:
            return self.buffer(buffer).bytes_per_token()
        return sum(b.bytes_per_token() for b in self.buffers)

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes of one token on one layer, over the buffers that layer carries."""
        return sum(b.row_bytes for b in self.buffers_on(layer))

    def with_layers(self, num_layers: int) -> KVSpec:
        """The same spec cut to its first `num_layers` layers (benchmarks time one layer)."""
        buffers = []
        for b in self.buffers:
            kept = tuple(layer for layer in b.layers if layer < num_layers)
            if kept:
                buffers.append(replace(b, layers=kept))
        return replace(self, num_layers=num_layers, buffers=tuple(buffers))


def mha_spec(
    name: str,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 1,
) -> KVSpec:
    """Standard attention: separate K and V rows of `[kv_heads, head_dim]` on every layer."""
    k = BufferSpec("k", BufferKind.K, (kv_heads, head_dim), dtype, tuple(range(num_layers)))
    v = replace(k, name="v", kind=BufferKind.V)
    return KVSpec(name=name, num_layers=num_layers, page_size=page_size, buffers=(k, v))


def mla_spec(
    name: str,
    num_layers: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 1,
    indexer_layers: Iterable[int] | None = None,
    packed_fp8: bool = False,
) -> KVSpec:
    """MLA: one latent row of `kv_lora_rank + rope_dim` per token; optional DSA indexer rows.

    With `packed_fp8` the latent row is the packed fp8 form (`uint8`, 656 bytes for 512 + 64).
    `indexer_layers` adds a `[132]` `uint8` row (fp8 key + fp32 scale) on those layers.
    """
    if packed_fp8 and (kv_lora_rank, rope_dim) != (512, 64):
        raise SpecError("the packed fp8 MLA row is defined for 512 + 64 only")
    row = (PACKED_FP8_MLA_ROW_BYTES,) if packed_fp8 else (kv_lora_rank + rope_dim,)
    layers = tuple(range(num_layers))
    buffers = (BufferSpec("kv", BufferKind.MLA_LATENT, row, torch.uint8 if packed_fp8 else dtype, layers),)
    if indexer_layers is not None:
        buffers += (_indexer(indexer_layers),)
    return KVSpec(name=name, num_layers=num_layers, page_size=page_size, buffers=buffers)


def indexer_spec(name: str, num_layers: int, page_size: int = 1) -> KVSpec:
    """The DSA indexer rows alone (`[132]` uint8 per token on every layer), for benchmarks."""
    return KVSpec(
        name=name, num_layers=num_layers, page_size=page_size, buffers=(_indexer(range(num_layers)),)
    )


def _indexer(layers: Iterable[int]) -> BufferSpec:
    return BufferSpec(
        "indexer", BufferKind.INDEXER, (INDEXER_ROW_BYTES,), torch.uint8, tuple(sorted(set(layers)))
    )


# Named presets. Real ones follow the models' public configs; tiny ones are for tests.
PRESETS: dict[str, Callable[[], KVSpec]] = {
    "llama-3.1-8b": lambda: mha_spec("llama-3.1-8b", 32, 8, 128, torch.bfloat16),
    "deepseek-v3": lambda: mla_spec("deepseek-v3", 61, 512, 64, torch.bfloat16),
    "deepseek-v3-fp8": lambda: mla_spec("deepseek-v3-fp8", 61, 512, 64, torch.float8_e4m3fn),
    "deepseek-v3-fp8-packed": lambda: mla_spec("deepseek-v3-fp8-packed", 61, packed_fp8=True),
    # GLM-5 style: 78 layers of DeepSeek-V3.2-style MLA with a DSA indexer on every layer.
    "glm-5": lambda: mla_spec("glm-5", 78, 512, 64, torch.bfloat16, indexer_layers=range(78)),
    "glm-5-fp8": lambda: mla_spec("glm-5-fp8", 78, packed_fp8=True, indexer_layers=range(78)),
    "glm-5-indexer": lambda: indexer_spec("glm-5-indexer", 78),
    # Tiny presets for tests: small rows, few layers, an indexer on some layers only.
    "tiny-mha": lambda: mha_spec("tiny-mha", 2, 2, 8, torch.bfloat16),
    "tiny-mha-fp16": lambda: mha_spec("tiny-mha-fp16", 2, 2, 8, torch.float16),
    "tiny-mla": lambda: mla_spec("tiny-mla", 3, 16, 8, torch.bfloat16),
    "tiny-mla-fp8": lambda: mla_spec("tiny-mla-fp8", 3, 16, 8, torch.float8_e4m3fn),
    "tiny-dsa": lambda: mla_spec("tiny-dsa", 3, 16, 8, torch.bfloat16, indexer_layers=(0, 2)),
}


def preset(name: str, page_size: int = 1) -> KVSpec:
    """The named preset with the given page size."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown spec preset {name!r}; known: {sorted(PRESETS)}") from None
    return replace(make(), page_size=page_size)
