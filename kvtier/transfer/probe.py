"""The planner's costs measured on this machine, once per device and process (`measured_costs`).

Why: the rate at which the SMs read pinned host memory belongs to the host, not only the GPU
(0.92 of the copy ceiling on one H100 host, 0.55-0.63 on two others), and so does the rate of
short copies (bench/FINDINGS.md, "The planner's costs"); there the fixed `PathCosts` give the
kernel loads the copy engine moves up to 0.4 of the ceiling faster.

Per direction, on scratch pools of `ROWS` rows of `ROW_BYTES` (about 9 MiB a transfer), each the
median of `REPEATS` timings with the stream held by a GPU sleep: the ceiling (one contiguous
copy); the kernel on the same rows (its share against the fixed rule's gives `kernel_scale`); and
copies and the kernel on host runs of `RUN_ROWS` rows (a gap after each): the shortest run size
from which copies win at every longer size gives `copy_min_bytes`, its time per copy `copy_host_s`.
The fixed rule moves only where the measurement contradicts it by more than `MARGIN`: the kernel
scaled down, never up; `copy_min_bytes` lowered, never raised. `KVTIER_MEASURE_COSTS=0`: off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import statistics
from collections.abc import Callable

import torch

from kvtier.errors import KVTierError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.spec import BufferKind, BufferSpec, KVSpec
from kvtier.transfer import kernels
from kvtier.transfer.execute import backup, load_layers
from kvtier.transfer.options import MeasuredCosts, PathCosts, TransferPath
from kvtier.transfer.plan import TransferPlan

log = logging.getLogger(__name__)

ROW_BYTES = 1152  # an MLA latent row in bf16 (512 + 64)
ROWS = 8192
RUN_ROWS = (4, 16, 64)  # runs of 4.5, 18 and 72 KiB
REPEATS = 5
BATCH = 4
MARGIN = 0.05
HOLD_CYCLES = 6_000_000  # a GPU sleep that outlasts issuing a timed batch


def held_median_s(
    stream: torch.cuda.Stream, call: Callable[[], None], repeats: int, batch: int, hold_cycles: int
) -> float:
    """Seconds of one `call` on `stream`: the median over `repeats` of `batch` back-to-back calls,
    issued while a GPU sleep of `hold_cycles` holds the stream, so the host's cost of issuing them
    is not timed (as in the middle of a load, where the GPU is still busy)."""
    samples = []
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(hold_cycles)
            start.record(stream)
            for _ in range(batch):
                call()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(samples)


def enabled() -> bool:
    """Whether `KVTIER_MEASURE_COSTS` leaves the measurement on (anything but `0`, `false`, `no`, `off`)."""
    return os.environ.get("KVTIER_MEASURE_COSTS", "1").strip().lower() not in ("0", "false", "no", "off")


def measured_costs(device: torch.device | str, base: PathCosts | None = None) -> MeasuredCosts | None:
    """The costs measured on CUDA `device` from `base` (default `PathCosts()`), once per process; None
    where nothing is measured (not CUDA, no Triton, turned off) or the measurement failed (logged)."""
    device = torch.device(device)
    if device.type != "cuda" or not enabled() or not kernels.runs_on(device):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured(index, base or PathCosts())


@functools.lru_cache(maxsize=16)
def _measured(index: int, base: PathCosts) -> MeasuredCosts | None:
    device = torch.device("cuda", index)
    try:
        with torch.cuda.device(device):
            out = _measure(device, base)
    except (KVTierError, RuntimeError) as e:  # a failed probe leaves the fixed rule, never a broken pool
        log.warning("planner costs: the measurement on %s failed (%s); the fixed costs stay", device, e)
        return None
    log.info("planner costs measured on %s: %s", device, out.evidence)
    return out


def _measure(device: torch.device, base: PathCosts) -> MeasuredCosts:
    spec = KVSpec(
        name="cost-probe",
        num_layers=1,
        page_size=1,
        buffers=(BufferSpec("kv", BufferKind.MLA_LATENT, (ROW_BYTES // 2,), torch.bfloat16, (0,)),),
    )
    host = HostPool(spec, 2 * ROWS, pin=True)
    dev = DevicePool(spec, ROWS, device)
    stream = torch.cuda.Stream(device)
    try:
        return MeasuredCosts(
            load=(lc := _direction(Direction.LOAD, host, dev, stream, base))[0],
            backup=(bc := _direction(Direction.BACKUP, host, dev, stream, base))[0],
            evidence={"load": lc[1], "backup": bc[1]},
        )
    finally:
        stream.synchronize()
        dev.close()
        host.close()


def _direction(
    direction: Direction, host: HostPool, dev: DevicePool, stream: torch.cuda.Stream, base: PathCosts
) -> tuple[PathCosts, dict]:
    """`(costs for direction, evidence)`; see the module docstring."""
    contiguous = torch.arange(ROWS)

    def seconds(host_slots: torch.Tensor, path: TransferPath) -> float:
        plan = TransferPlan.build(direction, host, dev, host_slots, contiguous, force=path, stream=stream)
        if direction is Direction.LOAD:
            call = functools.partial(load_layers, plan, host, dev, [0], stream)
        else:
            call = functools.partial(backup, plan, dev, host, [0], stream)
        call()  # the first call compiles or binds the kernel
        stream.synchronize()
        return held_median_s(stream, call, REPEATS, BATCH, HOLD_CYCLES)

    ceiling = seconds(contiguous, TransferPath.COPY)
    kernel = ceiling / seconds(contiguous, TransferPath.KERNEL)
    evidence: dict = {"ceiling_gbps": round(ROWS * ROW_BYTES / ceiling / 1e9, 2), "kernel": round(kernel, 3)}
    runs = {}
    for r in RUN_ROWS:
        gaps = (torch.arange(ROWS // r).unsqueeze(1) * 2 * r + torch.arange(r)).flatten()
        copy_s = seconds(gaps, TransferPath.COPY)
        runs[r] = (ceiling / copy_s, ceiling / seconds(gaps, TransferPath.KERNEL), copy_s / (ROWS // r))
        evidence[f"runs_{r * ROW_BYTES}"] = {"copy": round(runs[r][0], 3), "kernel": round(runs[r][1], 3)}
    costs, evidence["changes"] = adjust(base, kernel, {r * ROW_BYTES: v for r, v in runs.items()})
    return costs, evidence


def adjust(
    base: PathCosts, kernel: float, runs: dict[int, tuple[float, float, float]]
) -> tuple[PathCosts, dict]:
    """`(base changed where the measurement contradicts it by more than MARGIN, the changes)`.

    `kernel`: the kernel's share of the ceiling on contiguous rows (units of up to 16 KiB);
    `runs`: per run size in bytes, `(copies' share, the kernel's share, seconds per copy)` on
    runs of that size.
    """
    modelled = float(base.kernel_rate(16 << 10))
    changes: dict = {}
    if kernel < modelled - MARGIN:
        changes["kernel_scale"] = round(kernel / modelled, 3)
    sizes = sorted(runs)
    for size in sizes:
        copy, kern, per_copy = runs[size]
        longer_win = all(runs[n][0] >= runs[n][1] for n in sizes if n > size)
        if copy >= kern + MARGIN and longer_win:
            if size < base.copy_min_bytes:
                changes["copy_min_bytes"] = size
                changes["copy_host_s"] = round(per_copy, 9)  # a copy of that size, as timed
            break
    return dataclasses.replace(base, **changes), changes
