"""Moving KV rows between a `HostPool` and a `DevicePool`: plans (decided once) and their execution.

A `Planner` (or `TransferPlan.build`) decides on CPU indices, once per operation, how every
row moves; `load_layer`, `load_layers` and `backup` run the plan layer by layer on a stream.
Modules: `runs`, `options`, `launch` (the kernel's launch-shape rules), `parts` (one type
per mechanism), `staging` (staged parts) and `units` (the kernel's units), `costs` (what the
planner assumes each mechanism costs) and `calibrate` (measuring it, `kvtier calibrate`), `plan`,
`execute` (with `phases`, `staged`, `streams` and `moves`), `kernels` and `groups` (the Triton
kernels, beside `kernel_args`), `stacks` (`page_first` pages of several layers through staging),
`dma` (batched copy-engine calls), `strided` (2-D copies), `native` (the compiled submission
loop), `cudart` (the process's CUDA runtime); `lanes` and
`submit` (the cache's submission).

Glossary: one noun per concept, in every name and docstring of this package.

- slot: one token's place in a pool (a host slot, a device slot). A plan pairs
  `host_slots[i]` with `device_slots[i]`; `i` is the pair's position.
- row: one slot's bytes of one buffer on one layer (`BufferSpec.row_bytes`).
- page: `page_size` consecutive slots from a page-aligned id, what the allocators hand out.
- chunk: one host allocation (`HostPool`, at most `chunk_bytes`).
- segment: a maximal aligned range of host slots whose rows of one layer are contiguous in
  host memory (`HostPool.segment_slots`: a chunk's slots in `layer_first`, one page in
  `page_first`). No run crosses a segment edge.
- region: what one host base address reaches (`HostPool.locate`: slot -> `(region, row)`):
  a segment's rows of a layer in `layer_first`, a chunk's rows of a layer in `page_first`
  (its pages then lie a page's rows of every layer apart).
- run: consecutive positions whose host slots go up by one within a segment (a host run),
  whose device slots go up by one (a device run), or both (a joint run). A run cut at a
  window edge or into units is still a run. `RunTable` holds runs as columns; run lists
  (`RunList`) are the allocators' `(first slot, length)` pairs.
- part: the rows of a plan that one mechanism moves, of some or all buffers (`parts`); a
  path is what the whole plan does (`TransferPath`).
- window: one fill of a device staging buffer, up to `staging_tokens` rows of a staged part
  (of half of it, for stacks: the halves alternate).
- unit: the rows the kernel moves as one, a cut of a joint run contiguous on both sides (a
  whole page where every run allows).
- group: consecutive layers moved in one launch (`groups`); a unit's stack is its rows on
  a group's layers, adjacent on the host in `page_first`; a stack part moves whole pages'
  stacks by the copy engine (`stacks`).
- span: consecutive layers of one call that move together (`runs.layer_spans`), at most a
  group or a window's stacks.
- word: the integer element rows move as (8, 4, 2 or 1 bytes; `kvtier.pool.rows.as_words`).
- vector: up to 16 bytes of words, the widest access one thread makes.
- tile: the whole rows (or stacks) one kernel program holds in flight per step, as vectors;
  a stage is one tile in flight in a pipelined program.
- lane: a queue of transfer work on one stream (the cache's load and backup lanes); never
  part of a tile.
"""

from kvtier.transfer.execute import backup, load_layer, load_layers
from kvtier.transfer.options import KernelOptions, PathCosts, TransferPath
from kvtier.transfer.plan import Planner, TransferPlan

__all__ = [
    "KernelOptions",
    "PathCosts",
    "Planner",
    "TransferPath",
    "TransferPlan",
    "backup",
    "load_layer",
    "load_layers",
]
