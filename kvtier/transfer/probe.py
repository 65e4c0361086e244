"""The planner's costs measured on this machine, once per device and process (`measured_costs`).

Why: the rate at which the SMs read pinned host memory belongs to the host, not only the GPU
(0.92 of the copy ceiling on one H100 host, 0.55-0.63 on two others), and so does the rate of
short copies (bench/FINDINGS.md, "The planner's costs"); there the fixed `PathCosts` give the
kernel loads the copy engine moves up to 0.4 of the ceiling faster.

Per direction, on scratch pools of `ROWS` rows of `ROW_BYTES` (about 9 MiB a transfer), each the
median of `REPEATS` timings with the stream held by a GPU sleep: the ceiling (one contiguous
copy); the kernel on the same rows (its share against the fixed rule's gives `kernel_scale`); and
copies and the kernel on host runs of `RUN_ROWS` rows (a gap after each): the shortest run size
from which copies win at every longer size gives `copy_min_bytes`, the longest runs' time beyond
their bytes `copy_call_s`, the host's least time to issue a copy `copy_host_s` (`adjust`). The
fixed rule moves only where the measurement contradicts it: the kernel scaled down, never up;
`copy_min_bytes` lowered, never raised. `KVTIER_MEASURE_COSTS=0`: off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import statistics
import time
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
HOST_MARGIN = 0.2
HOLD_CYCLES = 6_000_000  # a GPU sleep that outlasts issuing a timed batch


def held_times(
    stream: torch.cuda.Stream, call: Callable[[], None], repeats: int, batch: int, hold_cycles: int
) -> tuple[float, float]:
    """`(device, host)` seconds of one `call` on `stream`, medians over `repeats` of `batch` back-to-back
    calls issued while a GPU sleep of `hold_cycles` holds the stream: the device's time leaves out the
    host's cost of issuing them (as in the middle of a load, the GPU still busy); the host's is that cost."""
    device, host = [], []
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(hold_cycles)
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(batch):
                call()
            host.append((time.perf_counter() - t0) / batch)
            end.record(stream)
            end.synchronize()
            device.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(device), statistics.median(host)


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
    row = BufferSpec("kv", BufferKind.MLA_LATENT, (ROW_BYTES // 2,), torch.bfloat16, (0,))
    spec = KVSpec(name="cost-probe", num_layers=1, page_size=1, buffers=(row,))
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

    def seconds(host_slots: torch.Tensor, path: TransferPath) -> tuple[float, float]:
        plan = TransferPlan.build(direction, host, dev, host_slots, contiguous, force=path, stream=stream)
        pools = (host, dev) if direction is Direction.LOAD else (dev, host)
        move = load_layers if direction is Direction.LOAD else backup
        call = functools.partial(move, plan, *pools, [0], stream)
        call()  # the first call compiles or binds the kernel
        stream.synchronize()
        return held_times(stream, call, REPEATS, BATCH, HOLD_CYCLES)

    ceiling = seconds(contiguous, TransferPath.COPY)[0]
    kernel = ceiling / seconds(contiguous, TransferPath.KERNEL)[0]
    evidence: dict = {"ceiling_gbps": round(ROWS * ROW_BYTES / ceiling / 1e9, 2), "kernel": round(kernel, 3)}
    runs = {}
    for r in RUN_ROWS:
        gaps = (torch.arange(ROWS // r).unsqueeze(1) * 2 * r + torch.arange(r)).flatten()
        (copy_s, host_s), kernel_s = seconds(gaps, TransferPath.COPY), seconds(gaps, TransferPath.KERNEL)[0]
        got = runs[r * ROW_BYTES] = (ceiling / copy_s, ceiling / kernel_s, host_s / (ROWS // r))
        evidence[f"runs_{r * ROW_BYTES}"] = _evidence(got)
    costs, evidence["changes"] = adjust(base, kernel, runs, ceiling)
    return costs, evidence


def _evidence(got: tuple[float, float, float]) -> dict:
    return {"copy": round(got[0], 3), "kernel": round(got[1], 3), "host_us": round(got[2] * 1e6, 3)}


def adjust(
    base: PathCosts, kernel: float, runs: dict[int, tuple[float, float, float]], ceiling_s: float
) -> tuple[PathCosts, dict]:
    """`(base changed where the measurement contradicts it by more than MARGIN, the changes)`.

    `kernel`: the kernel's share of the ceiling on contiguous rows (units of up to 16 KiB);
    `runs`: per run size in bytes, `(copies' share, the kernel's share, the host's seconds to issue
    a copy)` on runs of that size; `ceiling_s`: the ceiling's seconds (`ROWS` rows of `ROW_BYTES`).
    `copy_call_s` becomes what the longest runs' copies take beyond their bytes and `copy_fixed_s`
    (where that is off by more than MARGIN of the ceiling), `copy_host_s` the least host time a copy
    took (where off by more than HOST_MARGIN).
    """
    modelled = float(base.kernel_rate(16 << 10))
    changes: dict = {}
    if kernel < modelled - MARGIN:
        changes["kernel_scale"] = round(kernel / modelled, 3)
    sizes = sorted(runs)
    wins = [s for s in sizes if runs[s][0] >= runs[s][1] + MARGIN]  # copies win at every longer size too
    if wins and all(runs[n][0] >= runs[n][1] for n in sizes if n > wins[0]) and wins[0] < base.copy_min_bytes:
        changes["copy_min_bytes"] = wins[0]
    copies = ROWS * ROW_BYTES // sizes[-1]
    call = max(0.0, ceiling_s / runs[sizes[-1]][0] - ceiling_s - copies * base.copy_fixed_s)
    if abs(call - base.copy_call_s) > MARGIN * ceiling_s:
        changes["copy_call_s"] = round(call, 7)
    host = min(h for _, _, h in runs.values())
    if abs(host - base.copy_host_s) > HOST_MARGIN * base.copy_host_s:
        changes["copy_host_s"] = round(host, 9)
    return dataclasses.replace(base, **changes), changes
