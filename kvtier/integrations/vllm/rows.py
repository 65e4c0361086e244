"""vLLM's blocks <-> the connector's host rows with kvtier's row kernel: layer by layer, no host wait.

A block's bytes of one layer view (`BlockViews`) lie at byte `block * size` of the view on the
device and at `slot * block_bytes + at` of the pinned `[slots, block_bytes]` host rows (`at`: the
view's place in a row). The row kernel moves them directly, reading (loads) or writing (saves)
pinned host memory from a few SMs: no gather on the CPU, no staging copy, no host wait. Each block
row is cut into units of at most `KernelOptions.max_unit_bytes` (the kernel's rate is flat past a
few KiB, and a tile holds rows of at most 256 KiB). `prepare` shapes one launch per row size for
one set of blocks (the views of a size differ only in their base addresses, so every layer reuses
it); `run` launches one layer's views on the current stream.

Used where the row kernel runs (`kvtier.transfer.kernels.runs_on`): on CUDA, and under Triton's
interpreter, which the CPU tests use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from kvtier.pool.device import Direction
from kvtier.pool.rows import flat_words
from kvtier.transfer import KernelOptions, kernels

Upload = Callable[[torch.Tensor], torch.Tensor]


def unit_bytes(size: int, most: int) -> int:
    """The largest piece of a `size`-byte row that divides it into equal units of at most `most` bytes."""
    k = -(-size // most)
    while size % k:
        k += 1
    return size // k


class BlockRows:
    """The row kernel's moves between `views` (`BlockViews`) and `rows` (`[slots, block_bytes]` uint8,
    pinned host memory on CUDA)."""

    def __init__(self, views, rows: torch.Tensor, kernel: KernelOptions | None = None) -> None:
        self.views, self.rows = views, rows
        self.kernel = kernel or KernelOptions()
        host = rows.data_ptr()
        self._bases = [host + at for ats in views.offsets.values() for at in ats]
        self._bases += [v.data_ptr() for vs in views.views.values() for v in vs]
        self._sizes = sorted({v.shape[1] for vs in views.views.values() for v in vs})

    def prepare(
        self, blocks: np.ndarray, slots: np.ndarray, load: bool, upload: Upload
    ) -> dict[int, kernels.RowLaunch]:
        """Per row size, the launch that moves block `blocks[i]` <-> host slot `slots[i]` (`[n]` int64,
        in range) toward the device where `load`; `upload` puts its offsets on the device."""
        device = self.views.device
        direction = Direction.LOAD if load else Direction.BACKUP
        out = {}
        for size in self._sizes:
            unit = unit_bytes(size, self.kernel.max_unit_bytes)
            pieces = np.arange(0, size, unit, dtype=np.int64)
            host_off = (slots.astype(np.int64)[:, None] * self.views.block_bytes + pieces).ravel()
            dev_off = (blocks.astype(np.int64)[:, None] * size + pieces).ravel()
            shape = self.kernel.launch(unit, kernels.common_alignment(host_off, dev_off), device, direction)
            src, dst = (host_off, dev_off) if load else (dev_off, host_off)
            grid = (shape.programs, shape.rows, shape.stages)
            out[size] = kernels.prepare_rows(unit, src, dst, self._bases, load, device, *grid, upload)
        return out

    def run(self, name: str, launches: dict[int, kernels.RowLaunch], load: bool) -> None:
        """Layer `name`'s views moved by `launches` (from `prepare`) on the current stream."""
        for v, at in zip(self.views.views[name], self.views.offsets[name], strict=True):
            launch = launches[v.shape[1]]
            launch.run(functools.partial(self._words, v, at, launch.shape.word, load))

    def _words(self, v: torch.Tensor, at: int, word: int, load: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`(src, dst)` as 1-D words of `word` bytes from the kernel's bases: the host rows from byte
        `at`, and the view."""
        host = flat_words(self.rows.view(-1)[at:], word)
        dev = flat_words(v.reshape(-1), word)
        return (host, dev) if load else (dev, host)
