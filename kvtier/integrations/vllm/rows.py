"""The connector's host rows and the row kernel's moves between them and vLLM's blocks.

`HostRows` is the host memory: one row per slot, `block_bytes` long, holding every layer's bytes of
one vLLM block. It is a `kvtier.pool.HostPool` of one layer whose page is one block (`page_spec`):
pinned in chunks of at most 1 GiB where the KV is on a GPU (one giant pin fails on some drivers,
and torch's pinned allocator rounds each allocation up to a power of two), refused before anything
is allocated where the host lacks the memory, and given back by `close()`. A row never crosses a
chunk's edge; the chunks lie apart, so a row's place is its byte offset from one base, the first
chunk's first byte (`offsets`), as the transfer package's kernel reads a chunked pool.

`BlockRows` moves blocks with kvtier's row kernel: a block's bytes of one layer view (`BlockViews`)
lie at byte `block * size` of the view on the device and at `offset(slot) + at` on the host (`at`:
the view's place in a row). The kernel reads (loads) or writes (saves) pinned host memory directly
from a few SMs: no gather on the CPU, no staging copy, no host wait. Each block row is cut into
units of at most `KernelOptions.max_unit_bytes` (the kernel's rate is flat past a few KiB, and a
tile holds rows of at most 256 KiB). `prepare` shapes one launch per row size for one set of
blocks (the views of a size differ only in their base addresses, so every layer reuses it); `run`
launches one layer's views on the current stream. Used where the row kernel runs
(`kvtier.transfer.kernels.runs_on`): on CUDA, and under Triton's interpreter, which the CPU tests use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError, SlotError
from kvtier.pool.device import Direction
from kvtier.pool.host import DEFAULT_CHUNK_BYTES, HostPool
from kvtier.pool.rows import flat_words
from kvtier.spec import BufferKind, BufferSpec, KVSpec
from kvtier.transfer import KernelOptions, kernels

Upload = Callable[[torch.Tensor], torch.Tensor]
BLOCK_BUFFER = "vllm_block"


def page_spec(block_bytes: int, block_size: int) -> KVSpec:
    """The storage page of one vLLM block: `block_size` tokens of `block_bytes / block_size` bytes."""
    if block_bytes % block_size:
        raise ConfigError(f"a block of {block_bytes} bytes is not a whole number of {block_size} tokens")
    row = BufferSpec(BLOCK_BUFFER, BufferKind.SIDECAR, (block_bytes // block_size,), torch.uint8, (0,))
    return KVSpec("vllm", 1, (row,), block_size)


class HostRows:
    """`slots` host rows of `block_bytes` for blocks of `block_size` tokens (see the module docstring);
    `pin`: pinned memory (the KV is on a GPU)."""

    def __init__(
        self, slots: int, block_bytes: int, block_size: int, pin: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        if slots <= 0:
            raise ConfigError(f"kvtier connector: a host pool of {slots} blocks of {block_bytes} bytes")
        self.slots, self.block_bytes, self.block_size = slots, block_bytes, block_size
        self.pool = HostPool(
            page_spec(block_bytes, block_size), slots * block_size, pin=pin, chunk_bytes=chunk_bytes
        )
        regions = -(-slots * block_size // self.pool.segment_slots)
        self._regions = [self.pool.region_words(BLOCK_BUFFER, 0, r).view(torch.uint8) for r in range(regions)]
        self._apart = self.pool.region_classes(BLOCK_BUFFER)[0][0]  # [regions] bytes from the base
        self._per_region = self.pool.segment_slots // block_size

    @property
    def base(self) -> torch.Tensor:
        """The first chunk's bytes from its first row: what `offsets` count from."""
        return self._regions[0]

    def row(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s `[block_bytes]` uint8 view into the pool."""
        if not 0 <= slot < self.slots:
            raise SlotError(f"kvtier connector: host slot {slot} is not in [0, {self.slots})")
        at = slot % self._per_region * self.block_bytes
        return self._regions[slot // self._per_region][at : at + self.block_bytes]

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """`[len(slots), block_bytes]` uint8: a copy of the rows of `slots`."""
        return torch.stack([self.row(s) for s in slots])

    def offsets(self, slots: np.ndarray) -> np.ndarray:
        """`[n]` int64 byte offsets of the rows of `slots` (`[n]` int64) from `base`."""
        region, row = self.pool.locate(BLOCK_BUFFER, slots.astype(np.int64) * self.block_size)
        return self._apart[region] + row * (self.block_bytes // self.block_size)

    def close(self) -> None:
        self._regions = []
        self.pool.close()


def unit_bytes(size: int, most: int) -> int:
    """The largest piece of a `size`-byte row that divides it into equal units of at most `most` bytes."""
    k = -(-size // most)
    while size % k:
        k += 1
    return size // k


class BlockRows:
    """The row kernel's moves between `views` (`BlockViews`) and `rows` (`HostRows`)."""

    def __init__(self, views, rows: HostRows, kernel: KernelOptions | None = None) -> None:
        self.views, self.rows = views, rows
        self.kernel = kernel or KernelOptions()
        host = rows.base.data_ptr()
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
        rows = self.rows.offsets(slots)
        out = {}
        for size in self._sizes:
            unit = unit_bytes(size, self.kernel.max_unit_bytes)
            pieces = np.arange(0, size, unit, dtype=np.int64)
            host_off = (rows[:, None] + pieces).ravel()
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
        `at` of the base, and the view."""
        host = flat_words(self.rows.base[at:], word)
        dev = flat_words(v.reshape(-1), word)
        return (host, dev) if load else (dev, host)
