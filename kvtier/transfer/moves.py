"""The two raw moves the executors share: a buffer's runs in bytes through the copy engine
(`copy_runs`), and the row kernel over a part's host regions (`kernel_regions`).

Both move one layer of one buffer between its host rows and device words (a layer tensor or the
staging buffer), on the current stream or the one given, stream-ordered; neither reads a device
value back. The plan computed every offset; nothing is validated here (`validate=False`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from kvtier.pool.device import Direction
from kvtier.pool.host import HostPool
from kvtier.pool.rows import flat_words
from kvtier.spec import BufferSpec
from kvtier.transfer import dma, kernels
from kvtier.transfer.parts import KernelRegion


def copy_runs(
    host_pool: HostPool,
    b: BufferSpec,
    layer: int,
    runs: Iterable[np.ndarray],
    dev_ptr: int,
    load: bool,
    stream: torch.cuda.Stream | None,
    streams: int,
) -> None:
    """Runs in bytes (`RunBytes`' `[k]` int64 columns) between host rows of `layer` and the device
    memory at `dev_ptr`, in one batched call (`dma.copy_runs`) over `streams` streams."""
    region, host_off, dev_off, nbytes = runs
    host_ptrs = host_pool.region_ptrs(b.name)[b.local_layer(layer), region] + host_off
    dev_ptrs = dev_ptr + dev_off
    if load:
        dma.copy_runs(dev_ptrs, host_ptrs, nbytes, stream, streams=streams)
    else:
        dma.copy_runs(host_ptrs, dev_ptrs, nbytes, stream, streams=streams)


def kernel_regions(
    direction: Direction,
    regions: tuple[KernelRegion, ...],
    unit: int,
    host_pool: HostPool,
    dev_w: torch.Tensor,
    b: BufferSpec,
    layer: int,
) -> None:
    """Units of `unit` rows between the host rows of `layer` and `dev_w` (words: a layer tensor or the
    staging buffer), one launch per host region in the shape the plan gave it."""
    for region in regions:
        launch = region.launch
        # Words of the width the plan's offsets are in (no rescaling on the device).
        dev_flat = flat_words(dev_w.view(-1), region.word)
        host_flat = flat_words(host_pool.region_words(b.name, layer, region.region), region.word)
        src, dst = (host_flat, dev_flat) if direction is Direction.LOAD else (dev_flat, host_flat)
        kernels.copy_rows(
            src,
            region.src,
            dst,
            region.dst,
            b.row_bytes * unit // region.word,
            sm_budget=launch.programs,
            rows_per_program=launch.rows,
            validate=False,
            offsets_align=region.align,
            stages=launch.stages,
        )
