"""An operation that the copy engine moves whole, submitted from one compiled loop.

A reload makes two runtime calls per model layer (its copies, then its event); from Python they
cost several times the driver's own work (bench/FINDINGS.md). `Native.copy_layers` computes every
layer's addresses in C and makes the calls itself: one foreign call per operation. The loop is
compiled on first use with the system C compiler into the user's cache directory and calls the
process's `libcudart` through function pointers (`cudart`). Without a compiler, or with
`KVTIER_NATIVE=0`, `library()` is None and callers submit through the plan executor.

Contract: the calls are made in order on the stream named, exactly as the same calls made one by
one; the first failing call stops the loop and raises `CudaRuntimeError` naming its layer.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier import paths
from kvtier.errors import (
    BackendUnavailableError,
    ConfigError,
    CudaRuntimeError,
    InvariantError,
    PlanError,
    TransferError,
)
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.transfer import cudart, dma
from kvtier.transfer.cudart import MEMCPY_DEFAULT

if TYPE_CHECKING:
    from kvtier.transfer.plan import RunCopies

log = logging.getLogger(__name__)


SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef int (*copy_fn)(void *, const void *, size_t, int, void *);
typedef int (*batch_fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);

#define P(x) ((void *)(intptr_t)(x))

/* The runtime's entry points, as `Native` binds them once. */
typedef struct {
    copy_fn copy;
    batch_fn batch; /* NULL where the runtime has none */
    record_fn record;
    wait_fn wait;
    void *attrs;
    int64_t copy_kind;
} kvtier_runtime;

/* One buffer of a pool pair, as `kvtier_run_layers` addresses its rows. */
typedef struct {
    int64_t row_bytes;     /* bytes of one slot's row */
    int64_t region_slots;  /* host slots per region: region = slot / region_slots */
    int64_t page;          /* within a region, slot r is row (r / page) * page_rows + r % page */
    int64_t page_rows;
    int64_t regions;       /* columns of `host` */
    const int64_t *host;   /* [buffer layers, regions]: address of each region's first row per layer */
    const int64_t *device; /* [buffer layers]: address of each layer's first device row */
    const int64_t *local;  /* [model layers]: the buffer's layer of each model layer, or -1 */
} kvtier_buffer;

/* The int64 arguments of kvtier_run_layers, in order (see `Native.copy_layers`). */
enum { RUNS, N, BUFS, N_BUFS, LAYERS, LOAD, EVENTS, N_EVENTS, STREAM, ORDER_EVENT, ORDER_STREAM, SMALL };
/* Its own failures, before any runtime call (runtime errors are positive). */
enum { NO_BATCH = -1, NO_MEMORY = -3 };

/* Copy joint runs (`runs` [3, n]: first host slot, first device slot, length) of every buffer
   on every model layer, on `stream`, recording events[l] after layer l's copies (one event:
   after the last layer). First, when `order_event` is set, the stream waits for the work
   queued on `order_stream`. Load: device <- host, else host <- device. A buffer with more than
   `small` runs takes one batched call per layer. 0, or the first error and its layer (-1: the
   ordering calls, `layers`: the last record). */
int kvtier_run_layers(const kvtier_runtime *rt, const int64_t *args, int64_t *failed_layer) {
    const int64_t *runs = (const int64_t *)P(args[RUNS]), *events = (const int64_t *)P(args[EVENTS]);
    const kvtier_buffer *bufs = (const kvtier_buffer *)P(args[BUFS]);
    int64_t n = args[N], n_bufs = args[N_BUFS], layers = args[LAYERS], n_events = args[N_EVENTS];
    int64_t small = args[SMALL];
    int load = (int)args[LOAD];
    void *stream = P(args[STREAM]), *order_event = P(args[ORDER_EVENT]);
    void *order_stream = P(args[ORDER_STREAM]);
    copy_fn copy = rt->copy;
    batch_fn batch = rt->batch;
    record_fn record = rt->record;
    int copy_kind = (int)rt->copy_kind;
    int err = 0;
    int64_t *scratch = NULL; /* a batched call's dst [n], src [n], bytes [n] */
    *failed_layer = -1;
    if (n > small) { /* before any call, so a failure here submits nothing */
        if (!batch) return NO_BATCH;
        if (!(scratch = malloc(3 * n * sizeof(int64_t)))) return NO_MEMORY;
    }
    if (order_event && !(err = record(order_event, order_stream))) err = rt->wait(stream, order_event, 0);
    if (err) {
        free(scratch);
        return err;
    }
    for (int64_t l = 0; l < layers && !err; l++) {
        *failed_layer = l;
        for (int64_t b = 0; b < n_bufs && !err; b++) {
            const kvtier_buffer *f = bufs + b;
            int64_t j = f->local[l];
            if (j < 0) continue;
            const int64_t *host = f->host + j * f->regions;
            int64_t dev = f->device[j], rb = f->row_bytes;
            for (int64_t r = 0; r < n && !err; r++) {
                int64_t h = runs[r], region = h / f->region_slots, rel = h - region * f->region_slots;
                int64_t ha = host[region] + ((rel / f->page) * f->page_rows + rel % f->page) * rb;
                int64_t da = dev + runs[n + r] * rb, bytes = runs[2 * n + r] * rb;
                int64_t dst = load ? da : ha, src = load ? ha : da;
                if (scratch) {
                    scratch[r] = dst, scratch[n + r] = src, scratch[2 * n + r] = bytes;
                } else {
                    err = copy(P(dst), P(src), (size_t)bytes, copy_kind, stream);
                }
            }
            if (!err && scratch) {
                size_t attrs_index = 0;
                err = batch((void **)scratch, (void **)(scratch + n), (size_t *)(scratch + 2 * n), (size_t)n,
                            rt->attrs, &attrs_index, 1, stream);
            }
        }
        if (!err && n_events == layers) err = record(P(events[l]), stream);
    }
    if (!err && n_events == 1 && n_events != layers) err = record(P(events[0]), stream);
    free(scratch);
    return err;
}
"""


class Buffers:
    """Every buffer of a pool pair as `kvtier_run_layers` addresses its rows (`HostPool.row_map`, host
    `[buffer layers, regions]` and device `[buffer layers]` int64 addresses), built once per pair."""

    class _Row(ctypes.Structure):
        _fields_ = [
            *((f, ctypes.c_int64) for f in ("row_bytes", "region_slots", "page", "page_rows", "regions")),
            *((f, ctypes.c_void_p) for f in ("host", "device", "local")),
        ]

    def __init__(self, host_pool: HostPool, device_pool: DevicePool) -> None:
        spec = host_pool.spec
        self.host_pool, self.device_pool, self.layers = host_pool, device_pool, spec.num_layers
        self._keep: list[np.ndarray] = []
        self._rows = (self._Row * len(spec.buffers))()
        for row, b in zip(self._rows, spec.buffers, strict=True):
            on = list(b.layers)
            host = np.ascontiguousarray(host_pool.region_ptrs(b.name), dtype=np.int64)
            device = np.ascontiguousarray(device_pool.layer_ptrs(b.name), dtype=np.int64)
            local = np.full(self.layers, -1, dtype=np.int64)
            local[on] = np.arange(len(on))
            if host.shape[0] != len(on) or device.shape != (len(on),):
                raise InvariantError(
                    f"a buffer on {len(on)} layers has host {host.shape}, device {device.shape} addresses"
                )
            self._keep += (host, device, local)
            row.row_bytes, row.regions = b.row_bytes, host.shape[1]
            row.region_slots, row.page, row.page_rows = host_pool.row_map(b.name)
            row.host, row.device, row.local = host.ctypes.data, device.ctypes.data, local.ctypes.data
        self.address = ctypes.addressof(self._rows)
        self.count = len(spec.buffers)


# `kvtier_run_layers`' own failures (the C enum), made before any runtime call.
_LOOP_ERRORS = {-1: "the runs need the batched copy call, which the runtime lacks", -3: "out of host memory"}


class _Runtime(ctypes.Structure):
    """`kvtier_runtime`: the runtime's entry points, bound once and read by the loop."""

    _fields_ = [
        *((f, ctypes.c_void_p) for f in ("copy", "batch", "record", "wait", "attrs")),
        ("copy_kind", ctypes.c_int64),
    ]


class Native:
    """The compiled loops bound to a runtime's entry points (addresses as ints; 0 for a missing batch)."""

    def __init__(
        self, lib: ctypes.CDLL, copy: int, batch: int, record: int, wait: int, attrs: int = 0
    ) -> None:
        ptr = ctypes.c_void_p
        layers = lib.kvtier_run_layers
        layers.argtypes = [ptr, ptr, ptr]
        layers.restype = ctypes.c_int
        self._layers, self._lib = layers, lib
        self._runtime = _Runtime(copy, batch or None, record, wait, attrs or None, MEMCPY_DEFAULT)
        self._runtime_address = ctypes.addressof(self._runtime)
        self.has_batch = bool(batch)

    def copy_layers(
        self,
        runs: np.ndarray,
        buffers: Buffers,
        load: bool,
        events: list[int],
        stream: int,
        order: tuple[int, int] | None,
        small: int,
    ) -> None:
        """Copy joint runs of every buffer, layer by layer, with `events` recorded (see the C source).

        `runs`: `[3, n]` int64 C-contiguous (first host slot, first device slot, length);
        `events`: one raw event handle per model layer, or one for the end; `order`: `(event,
        stream)` handles the copies wait behind; more than `small` runs: one batched call.
        """
        if len(events) not in (1, buffers.layers):
            raise ConfigError(f"{len(events)} events for {buffers.layers} layers (one per layer, or one)")
        if runs.dtype != np.int64 or runs.ndim != 2 or len(runs) != 3 or not runs.flags.c_contiguous:
            raise TransferError(f"runs must be [3, n] C-contiguous int64, got {runs.dtype} {runs.shape}")
        n = runs.shape[1]
        if n > small and not self.has_batch:
            raise BackendUnavailableError(f"{n} runs need the batched copy call, which this runtime lacks")
        handles = array.array("q", events)  # int64, as the loop reads them
        order_event, order_stream = order or (0, 0)
        # One int64 array of arguments (the loop's `args`): a foreign call with three arguments
        # costs less than with nineteen, most of all when the process's caches are cold.
        args = array.array(
            "q",
            (
                runs.ctypes.data, n, buffers.address, buffers.count, buffers.layers, int(load),
                handles.buffer_info()[0], len(events), stream, order_event, order_stream, small,
            ),
        )  # fmt: skip
        failed = ctypes.c_int64(-1)
        err = self._layers(self._runtime_address, args.buffer_info()[0], ctypes.byref(failed))
        if err in _LOOP_ERRORS:
            raise CudaRuntimeError(f"copying runs failed before any call: {_LOOP_ERRORS[err]}")
        if err:
            where = "ordering after the compute stream" if failed.value < 0 else f"layer {failed.value}"
            raise CudaRuntimeError(f"copying runs failed at {where}: CUDA error {err}")


def compile_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled loop, built once per source into `cache_dir` (default: `kvtier.paths.cache_dir()`)
    and kept there; None without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler found to build the submission loop")
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    out_dir = cache_dir or paths.cache_dir()
    target = out_dir / f"kvtier_loop_{digest}.so"
    if not target.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "loop.c"
                src.write_text(SOURCE)
                built = Path(tmp) / target.name
                cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(src)]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders each install a whole file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("could not compile the submission loop (%s %s)", e, detail.decode(errors="replace"))
            return None
    return ctypes.CDLL(str(target))


def _find_library() -> Native | None:
    """The loop bound to the process's CUDA runtime, or None, saying why once (at INFO)."""
    if os.environ.get("KVTIER_NATIVE", "1") == "0":
        log.info("the compiled submission loop is off (KVTIER_NATIVE=0): transfers use the plan executor")
        return None
    rt = cudart.runtime()
    if rt is None:
        log.info("no CUDA runtime in the process: no compiled submission loop")
        return None
    lib = compile_library()
    if lib is None:
        log.info("no compiled submission loop: transfers use the plan executor")
        return None
    batch, attrs = dma.direct_batch_fn() or (None, 0)
    entries = (rt.memcpy_async, batch, rt.event_record, rt.stream_wait_event)
    native = Native(lib, *(_address(fn) for fn in entries), attrs)
    log.info("transfers submitted from a compiled loop (%s)", lib._name)
    return native


# The loop of this process, found once (`cudart.Probed`: tests pin a stand-in with `set`).
LIBRARY: cudart.Probed[Native | None] = cudart.Probed(_find_library)


def library() -> Native | None:
    """The loop bound to the process's CUDA runtime, or None (no runtime, no compiler, or disabled)."""
    return LIBRARY.get()


def _address(fn) -> int:
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def run_buffers(host_pool: HostPool, device_pool: DevicePool) -> Buffers | None:
    """The pools' buffers as `Native.copy_layers` addresses them, or None where some buffer cannot
    take raw copies here."""
    if dma.dma_mode() is dma.DmaMode.TORCH or not all(
        device_pool.raw_rows(b.name) for b in host_pool.spec.buffers
    ):
        return None
    return Buffers(host_pool, device_pool)


def loop_takes(lib: Native, copies: RunCopies) -> bool:
    """Whether `run_layers` can submit `copies`: not where one layer's runs would fan out over
    several streams, nor where they need the batched call and the loop lacks it."""
    runs = copies.joint.shape[1]
    return runs <= dma.small_batch() or (lib.has_batch and not dma.fans_out(runs, copies.streams))


def run_layers(
    lib: Native,
    copies: RunCopies,
    buffers: Buffers,
    direction: Direction,
    stream: int,
    current: int,
    order: int,
    events: list[int],
) -> None:
    """Submit `copies` on every layer from the compiled loop: the plan executor's raw copies (where
    `loop_takes` them), after ordering raw stream `stream` behind `current` with raw event `order`;
    `events`: one raw event handle per model layer, recorded after its copies, or one at the end.
    """
    if copies.host_pool is not buffers.host_pool or copies.device_pool is not buffers.device_pool:
        raise PlanError(
            f"the copies were planned for {copies.host_pool} and {copies.device_pool}, the buffers "
            f"hold the addresses of {buffers.host_pool} and {buffers.device_pool}"
        )
    load = direction is Direction.LOAD
    lib.copy_layers(copies.joint[1:], buffers, load, events, stream, (order, current), dma.small_batch())
