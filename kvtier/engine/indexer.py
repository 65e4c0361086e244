"""The DSA indexer rows the engine writes itself: a deterministic stand-in for each token's index key.

A model whose config declares a DSA indexer (`kvtier.engine.hf.dsa_indexer_layers`) but
whose forward computes no index keys (a DeepSeek-V3 model with the DSA config fields set,
as `kvtier bench served`'s `glm-5` setup) still has an indexer buffer in its spec, so
its reloads move the real bytes per token. The step (`kvtier.engine.batch.StepBatch`)
writes each new token's row on each indexer layer from `standin_rows`: bytes derived
from the token's position, its id and the layer (the token's part once per step,
`token_rows`, the layer's by one XOR, `on_layer`), so a row read back after a round trip
through the host can be checked against what was written. They are not index keys: no
attention reads them, and a model that computes real ones (transformers' own DSA
classes, through `Cache.update_indexer`) is refused by the engine.
"""

from __future__ import annotations

import torch

from kvtier.errors import InvariantError
from kvtier.spec import INDEXER_ROW_BYTES

# Odd multipliers (so each input changes the low bytes) and a shift that folds high bits down.
_POSITION, _TOKEN, _BYTE, _MIX = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F, 0x2C1B3C6D
# Layer l's rows are the token's rows XOR this times l (mod 256): one op per layer in a step.
_LAYER = 0x3B


def token_rows(positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`[T, INDEXER_ROW_BYTES]` uint8: each token's stand-in row before its layer is mixed in.

    `positions`, `ids`: `[T]` int64 on one device (the rows are made there).
    """
    if positions.shape != ids.shape or positions.dim() != 1:
        raise InvariantError(
            f"positions {tuple(positions.shape)} and ids {tuple(ids.shape)} must be [T] alike"
        )
    mask = (1 << 31) - 1  # products of 31-bit values stay inside int64
    seed = (positions * _POSITION + ids * _TOKEN) & mask
    j = torch.arange(INDEXER_ROW_BYTES, device=positions.device, dtype=torch.int64)
    x = (seed.unsqueeze(1) + j * _BYTE) & mask
    x = (x ^ (x >> 15)) * _MIX & mask
    return ((x ^ (x >> 12)) & 0xFF).to(torch.uint8)


def on_layer(rows: torch.Tensor, layer: int) -> torch.Tensor:
    """`[T, INDEXER_ROW_BYTES]` uint8: `token_rows`' rows as layer `layer` keeps them."""
    return rows ^ (layer * _LAYER & 0xFF)


def standin_rows(positions: torch.Tensor, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """`[T, INDEXER_ROW_BYTES]` uint8: the stand-in indexer row of each token on `layer`.

    `positions`, `ids`: `[T]` int64 on one device.
    """
    return on_layer(token_rows(positions, ids), layer)
