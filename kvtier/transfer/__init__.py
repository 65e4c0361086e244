"""Moving KV rows between a `HostPool` and a `DevicePool`: plans (decided once) and their execution.

A `Planner` (or `TransferPlan.build`) decides on CPU indices, once per operation, how every row
moves; `load_layer`, `load_layers` and `backup` run the plan layer by layer on a stream, and
`submit.Transfers` is the one entry point the cache calls.

The mechanisms (`parts`):
- the copy engine, one copy per joint run, every run of a layer in one batched call (`cudart`); it
  holds no SMs;
- the row kernel (`kernels`), reading or writing pinned host memory directly, runs cut into
  units of up to `KernelOptions.max_unit_bytes`; any layout of slots;
- the reference path, token by token, for device tensors that are not packed rows (an engine's
  own) and for plans where neither of the others runs (no Triton, no CUDA).
Where a C compiler and the CUDA runtime are at hand, one compiled loop submits a whole operation,
copies and kernel launches on every layer (`native`, `loop`); else the plan executor (`execute`).

The planner's rule (`rule`), for each buffer: sort the plan's joint runs longest first and give
the copy engine the j longest, the kernel the rest, for the j that makes

    time(j) = [j > 0] copy_call_s + max(j x copy_fixed_s + (bytes of the j) / B, j x copy_host_s)
            + [rows left] (launch_fixed_s + [j > 0] split_s + (bytes left) / (B x kernel_rate(unit)))

least, B being the link's rate; runs under `copy_min_bytes` are copied only beside a longer one
(or where the plan is one run). Every j from 0 (all kernel) to all is weighed: one joint run is one
copy; long runs go to the copy engine once there are enough of them to pay for the call; thousands
of short copies are bound by the host issuing them (`copy_host_s`); single rows and short runs go
to the kernel in one launch, after the copies (`split_s`). With several buffers, copying every run
of all of them (a call each; the host issues every copy while the link moves every byte) wins
where it beats their own choices together. Without the kernel (no Triton, a CPU pool): a copy per
run where that beats the reference path, else the reference path. `PathCosts` holds the costs
(bench/FINDINGS.md, "The planner's costs"); on CUDA `probe` checks them once per process: a host
whose SMs read its memory slower scales the kernel's shares down, one whose short copies run at
the link's rate lowers `copy_min_bytes` (loads and backups may then weigh differently).

Glossary, one noun per concept:
- slot: one token's place in a pool. A plan pairs `host_slots[i]` with `device_slots[i]`.
- row: one slot's bytes of one buffer on one layer (`BufferSpec.row_bytes`).
- page: `page_size` consecutive slots from a page-aligned id, what the allocators hand out.
- segment: a maximal aligned range of host slots whose rows of one layer are contiguous
  (`HostPool.segment_slots`); no run crosses a segment edge.
- region: what one host base address reaches (`HostPool.locate`).
- run: consecutive positions whose host slots go up by one within a segment (a host run),
  whose device slots go up by one (a device run), or both (a joint run).
- part: the rows of a plan that one mechanism moves, of some or all buffers.
- unit: the rows the kernel moves as one, a cut of a joint run.
- lane: a queue of transfer work on one stream (the cache's load and backup lanes).
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
