"""Measuring what each mechanism costs on this GPU (`calibrate`), once, cached on disk (`model_for`).

A calibration times, in each direction, on scratch pinned and device buffers of
`SCRATCH_BYTES`, with the same calls a plan makes:

- batched copy-engine copies of pieces of each of `COPY_PIECES` bytes, fanned out as the
  planner fans them out, at line-aligned addresses and `UNALIGNED_SHIFT` bytes past them,
  `COPY_BYTES` per call (up to `MAX_PIECES` pieces): as many pieces as one layer's runs, since
  batches of a few hundred pieces do not show what thousands cost;
- per row size asked for:
  - the on-device pass of staging (`index_copy_` onto scattered rows);
  - staging whole, as a plan stages one layer: the copies of host pieces of each of
    `STAGED_PIECES` bytes into a staging buffer and the device pass of its rows onto scattered
    rows (a backup: the device pass, then the copies out);
  - the row kernel on scattered single rows and on scattered units of `costs.unit_rows` rows
    (its launch shape from `KernelOptions`);
  - 2-D copies of lines of that size at a pitch of many rows (`page_first`).

Each figure is the median of `REPEATS` samples of `BATCH` back-to-back calls (copies: `COPY_REPEATS`
of `COPY_BATCH`) after a warm-up, issued while a GPU sleep holds the stream (the host's cost of
issuing is not timed). The result, a `costs.CostModel`, is kept in
`kvtier.paths.cache_dir()/calibration/`, one file per GPU model, driver and kvtier version; row
sizes it lacks are measured when first asked for and added. Planners on CUDA measure it at first
use, for their spec's row sizes (~3 s on a fresh machine, the kernel's launch shapes compiled
ahead from threads; 2-2.5 s with Triton's cache warm; every preset's at once ~5 s; under 0.1 s
from the cache file) and choose by it, floored as `costs` says,
unless `KVTIER_CALIBRATION=off`, or given a `CostModel`; `PathCosts`' thresholds are the fallback.
A calibration that fails logs a warning and leaves the thresholds; an unreadable cache file, or
one measured by an older method (`FORMAT`), is measured again. Why it is on and what it was
compared with: bench/FINDINGS.md, "The measured cost model".
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvtier import paths
from kvtier.errors import BackendUnavailableError, KVTierError
from kvtier.pool.device import Direction
from kvtier.pool.rows import WORD_DTYPES as WORDS
from kvtier.pool.rows import word_dtype
from kvtier.transfer import cudart, dma, kernel_args, kernels, strided
from kvtier.transfer.costs import CostModel, Rates, unit_rows
from kvtier.transfer.options import KernelOptions, PathCosts

log = logging.getLogger(__name__)

SCRATCH_BYTES = 256 << 20
MOVED_BYTES = 16 << 20
COPY_BYTES = 128 << 20
MAX_PIECES = 16384
# 32 KiB to 1 MiB (smaller: the nearest, 32 KiB). The planner takes no copy under its floor of 64 KiB
# (`costs`), and smaller pieces, thousands a call, are the calibration's slowest: their issuing.
COPY_PIECES = tuple(1 << k for k in range(15, 21))
# 64 KiB to 1 MiB, for the same floor.
STAGED_PIECES = tuple(1 << k for k in range(16, 21))
REPEATS = 5
BATCH = 4
# Copy calls of `COPY_BYTES` last milliseconds: fewer samples of fewer calls each.
COPY_REPEATS = 3
COPY_BATCH = 2
# Pieces of rows that are not whole 128-byte lines start this far past a line.
UNALIGNED_SHIFT = 16
HOLD_CYCLES = 4_000_000
# Threads that run the kernel's calls once before any is timed (`_Bench.kernel_calls`).
COMPILE_THREADS = 8
FORMAT = 8  # raised whenever the measuring changes, so older files are measured again

# `Rates`' tables measured per row size.
_BY_ROW = ("device_pass", "staged", "kernel_rows", "kernel_units", "strided")

# A kernel call of the calibration and the bytes it moves.
KernelCall = tuple[Callable[[], None], int]

_lock = threading.Lock()


def enabled() -> bool:
    """Whether planners calibrate (`KVTIER_CALIBRATION`: on unless `off`, `0`, `false` or `no`)."""
    return os.environ.get("KVTIER_CALIBRATION", "on").lower() not in ("off", "0", "false", "no")


def machine_key(device: torch.device) -> str:
    """`<GPU model>-driver-<version>-kvtier-<version>`, as a file name."""
    from kvtier import __version__

    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-driver-{driver_version()}-kvtier-{__version__}")


def driver_version() -> str:
    """The NVIDIA driver's version (`/proc/driver/nvidia/version`), else `unknown`."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9][0-9.]+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    return "unknown"


def cache_file(device: torch.device) -> Path:
    return paths.cache_dir() / "calibration" / f"{machine_key(device)}.json"


def model_for(device: torch.device, row_sizes: Iterable[int]) -> CostModel | None:
    """The cost model of `device` covering `row_sizes` (bytes): from the cache file, measuring what it
    lacks; None where calibration is off or fails (the planner then keeps `PathCosts`)."""
    if not enabled() or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _model_for(index, tuple(sorted(set(row_sizes))))


@functools.lru_cache(maxsize=64)
def _model_for(index: int, row_sizes: tuple[int, ...]) -> CostModel | None:
    device = torch.device("cuda", index)
    with _lock:
        try:
            return load_or_measure(device, row_sizes)
        except (KVTierError, RuntimeError, OSError) as e:
            log.warning("calibration on %s failed (%s); the planner uses its default thresholds", device, e)
            return None


def load_or_measure(device: torch.device, row_sizes: Iterable[int], force: bool = False) -> CostModel:
    """The cached model of `device` with every size of `row_sizes` measured (re-measured with `force`).

    Processes on one machine measure one at a time (`machine_lock`): ranks calibrating at once
    would share the host's memory and links, and each measure less than it has."""
    path, sizes = cache_file(device), sorted(set(row_sizes))
    with machine_lock(path):
        old = None if force else read(path)
        if old is not None and all(r.knows(s) and s in r.strided for r in old.rates.values() for s in sizes):
            return old
        model = calibrate(device, sizes, old)
        write(path, model)
        return model


@contextlib.contextmanager
def machine_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`'s `.lock` file beside it (created) while inside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read(path: Path) -> CostModel | None:
    """The model in `path`, or None where it is missing or unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            return None
        return CostModel.from_json(data["model"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the calibration file %s (%s)", path, e)
        return None


def write(path: Path, model: CostModel) -> None:
    """`model` into `path`, whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as fh:
        json.dump({"format": FORMAT, "model": model.to_json()}, fh, indent=1)
    os.replace(fh.name, path)


def calibrate(device: torch.device, row_sizes: Iterable[int], base: CostModel | None = None) -> CostModel:
    """Measure `device` (see the module docstring), keeping what `base` already holds for other sizes."""
    if device.type != "cuda" or not kernels.runs_on(device):
        raise BackendUnavailableError(f"calibration needs a CUDA device and Triton, not {device}")
    if dma.dma_mode() is dma.DmaMode.TORCH or cudart.runtime() is None:
        raise BackendUnavailableError("calibration needs raw copy-engine calls (cuda.bindings and libcudart)")
    row_sizes = sorted(set(row_sizes))
    log.info(
        "calibrating transfers on %s for rows of %s bytes (~2-5 s, once per GPU model, driver and kvtier "
        "version; KVTIER_CALIBRATION=off plans on fixed thresholds instead)",
        device,
        row_sizes,
    )
    t0 = time.perf_counter()
    bench = _Bench(device)
    kernel_calls = bench.kernel_calls(row_sizes)
    rates = {}
    for d in Direction:
        old = base.rates.get(d) if base else None
        copy = bench.copy_rates(d) if old is None else old.copy
        unaligned = bench.copy_rates(d, UNALIGNED_SHIFT) if old is None else old.copy_unaligned
        by_row = {k: dict(getattr(old, k)) if old else {} for k in _BY_ROW}
        for rb in row_sizes:
            by_row["device_pass"][rb] = bench.device_pass(rb)
            by_row["staged"][rb] = bench.staged_rates(d, rb)
            by_row["kernel_rows"][rb] = bench.rate(*kernel_calls[d, rb, 1])
            by_row["kernel_units"][rb] = bench.rate(*kernel_calls[d, rb, unit_rows(rb)])
            by_row["strided"][rb] = bench.strided(d, rb)
        rates[d] = Rates(copy, unaligned, **by_row)
    del bench
    torch.cuda.empty_cache()  # the device scratch back to the device, for pools sized after this
    source = f"calibrated {machine_key(device)}"
    log.info("calibrated %s for rows of %s bytes in %.1f s", device, row_sizes, time.perf_counter() - t0)
    return CostModel(source, rates)


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


def _batch(piece: int) -> tuple[int, np.ndarray, int]:
    """One timed call's copies of `piece` bytes: their count, `[count]` int64 sizes, and the streams the
    planner fans such pieces over (`PathCosts.fan_out_below_bytes`)."""
    costs = PathCosts()
    count = min(MAX_PIECES, COPY_BYTES // piece)
    fan = costs.copy_streams if piece < costs.fan_out_below_bytes else 1
    return count, np.full(count, piece, dtype=np.int64), fan


class _Bench:
    """Scratch buffers and timed calls for one calibration."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.host = torch.empty(SCRATCH_BYTES, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty(SCRATCH_BYTES, dtype=torch.uint8, device=device)
        self.rng = np.random.default_rng(0)

    def time(self, call: Callable[[], None], repeats: int = REPEATS, batch: int = BATCH) -> float:
        """Seconds of one call on the stream (`held_median_s`, after one warm-up)."""
        call()
        return held_median_s(self.stream, call, repeats, batch, HOLD_CYCLES)

    def sides(self, direction: Direction) -> tuple[int, int]:
        """`(destination, source)` base addresses of `direction`."""
        h, d = self.host.data_ptr(), self.dev.data_ptr()
        return (d, h) if direction is Direction.LOAD else (h, d)

    def places(self, piece: int, count: int) -> np.ndarray:
        """`count` distinct piece-aligned byte offsets in the scratch buffers, in random order: `[count]`."""
        return self.rng.permutation(SCRATCH_BYTES // piece)[:count].astype(np.int64) * piece

    def copy_rates(self, direction: Direction, shift: int = 0) -> dict[int, float]:
        """GB/s of batched copies of each of `COPY_PIECES` bytes, fanned out as the planner does, at
        piece-aligned addresses plus `shift` bytes."""
        out = {}
        dst, src = self.sides(direction)
        for piece in COPY_PIECES:
            count, sizes, fan = _batch(piece)
            at = np.minimum(self.places(piece, count) + shift, SCRATCH_BYTES - piece)
            t = self.time(
                lambda a=at, n=sizes, k=fan: dma.copy_runs(dst + a, src + a, n, self.stream, streams=k),
                COPY_REPEATS,
                COPY_BATCH,
            )
            out[piece] = count * piece / t / 1e9
        return out

    def staged_rates(self, direction: Direction, row_bytes: int) -> dict[int, float]:
        """GB/s of staging whole for host runs of rows of `row_bytes`, as many whole rows as fit each of
        `STAGED_PIECES` bytes (keyed by their bytes): a load's copies into the staging half of the
        device scratch (fanned out as the planner does), then `index_copy_` of its rows onto a
        permutation of as many rows in the other half; a backup's `index_select` first."""
        out, half = {}, SCRATCH_BYTES // 2
        for nominal in STAGED_PIECES:
            piece = max(1, nominal // row_bytes) * row_bytes
            count, sizes, fan = _batch(piece)
            rows = count * piece // row_bytes
            stage = self.rows(half, rows, row_bytes)
            slots = self.rows(0, rows, row_bytes)
            index = torch.from_numpy(self.rng.permutation(rows)).to(self.device)
            host = self.host.data_ptr() + self.places(piece, count)
            staged = stage.data_ptr() + np.arange(count, dtype=np.int64) * piece

            def call(host=host, staged=staged, sizes=sizes, fan=fan, stage=stage, slots=slots, index=index):
                if direction is Direction.LOAD:
                    dma.copy_runs(staged, host, sizes, self.stream, streams=fan)
                    slots.index_copy_(0, index, stage)
                else:
                    torch.index_select(slots, 0, index, out=stage)
                    dma.copy_runs(host, staged, sizes, self.stream, streams=fan)

            out[piece] = count * piece / self.time(call, COPY_REPEATS, COPY_BATCH) / 1e9
        return out

    def device_pass(self, row_bytes: int) -> float:
        """GB/s of the staging pass: `index_copy_` of `MOVED_BYTES` of rows of `row_bytes` onto scattered
        rows among twice as many (read + write)."""
        rows = MOVED_BYTES // row_bytes
        src, out = self.rows(0, rows, row_bytes), self.rows(rows * row_bytes, 2 * rows, row_bytes)
        index = torch.from_numpy(self.rng.permutation(2 * rows)[:rows]).to(self.device)
        t = self.time(lambda: out.index_copy_(0, index, src))
        return rows * row_bytes / t / 1e9

    def rows(self, at: int, count: int, row_bytes: int) -> torch.Tensor:
        """`count` rows of `row_bytes` of the device scratch from byte `at`, as words: `[count, words]`."""
        raw = self.dev[at : at + count * row_bytes].view(count, row_bytes)
        return raw.view(word_dtype(row_bytes))

    def rate(self, call: Callable[[], None], nbytes: int) -> float:
        """GB/s of `call`, which moves `nbytes`."""
        return nbytes / self.time(call) / 1e9

    def kernel_calls(self, row_sizes: Iterable[int]) -> dict[tuple[Direction, int, int], KernelCall]:
        """The row kernel's calls of this calibration, keyed by direction, row bytes and unit rows (1 and
        `costs.unit_rows`), each run once from `COMPILE_THREADS` threads: a launch shape's first run
        compiles it, and Triton's compiles (most of a fresh machine's calibration) overlap there."""
        shapes = {(d, rb, u) for d in Direction for rb in row_sizes for u in (1, unit_rows(rb))}
        calls = {s: self.kernel(*s) for s in sorted(shapes, key=lambda s: (s[0].name, s[1], s[2]))}
        kernels._kernel()  # the JIT wrapper made once, before the threads

        def first_run(call: KernelCall) -> None:
            with torch.cuda.stream(self.stream):  # a thread starts on the default stream
                call[0]()

        with ThreadPoolExecutor(max(1, min(COMPILE_THREADS, len(calls)))) as pool:
            for _ in pool.map(first_run, calls.values()):
                pass
        self.stream.synchronize()
        return calls

    def kernel(self, direction: Direction, row_bytes: int, unit: int) -> KernelCall:
        """The row kernel on scattered units of `unit` rows of `row_bytes`, as a plan launches it."""
        span = row_bytes * unit
        count = max(1, min(MOVED_BYTES // span, SCRATCH_BYTES // span // 2))
        src, dst = self.places(span, count), self.places(span, count)
        load = direction is Direction.LOAD
        return self.kernel_at(direction, span, *((src, dst) if load else (dst, src)))

    def kernel_at(
        self, direction: Direction, span: int, host_at: np.ndarray, dev_at: np.ndarray
    ) -> KernelCall:
        """The row kernel moving `span` bytes between each of `host_at` and `dev_at` (`[k]` int64 byte
        offsets in the scratch buffers), launched as a plan launches it on the current stream."""
        # As `units.unit_regions` shapes a plan's launch: the widest word the offsets allow.
        align = kernel_args.common_alignment(host_at, dev_at)
        word = kernel_args.word_size(span, [align])
        align_words = max(1, align // word)
        launch = KernelOptions().launch(span, align_words * word, self.device, direction)
        host, dev = self.host.view(WORDS[word]), self.dev.view(WORDS[word])
        load = direction is Direction.LOAD
        src, dst = (host, dev) if load else (dev, host)
        src_at, dst_at = (host_at, dev_at) if load else (dev_at, host_at)
        src_off = torch.from_numpy(src_at // word).to(self.device)
        dst_off = torch.from_numpy(dst_at // word).to(self.device)

        def call() -> None:
            kernels.copy_rows(
                src,
                src_off,
                dst,
                dst_off,
                span // word,
                sm_budget=launch.programs,
                rows_per_program=launch.rows,
                validate=False,
                offsets_align=align_words,
                stages=launch.stages,
            )

        return call, len(host_at) * span

    def strided(self, direction: Direction, line_bytes: int) -> float:
        """GB/s of one 2-D copy of lines of `line_bytes` whose host pitch is `PITCH_LINES` lines."""
        pitch = line_bytes * strided.PITCH_LINES
        lines = min(MOVED_BYTES // line_bytes, SCRATCH_BYTES // pitch)
        dst, src = self.sides(direction)
        load = direction is Direction.LOAD
        dpitch, spitch = (line_bytes, pitch) if load else (pitch, line_bytes)
        t = self.time(lambda: strided.copy_2d(dst, dpitch, src, spitch, line_bytes, lines, self.stream))
        return lines * line_bytes / t / 1e9
