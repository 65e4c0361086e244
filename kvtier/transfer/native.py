"""A whole operation's runtime calls submitted from one compiled loop.

A reload submits two runtime calls per model layer (its copies, then the event that
says the layer is in place). On an H200 host the driver's own work for the pair is
~3 us; from Python through ctypes it cost ~8 us, most of a 128k-token reload's
submission (bench/NOTES.md). A `Tape` collects the calls as rows of integers and
`run` hands the whole tape to a small C loop that makes them in order, so Python
pays one foreign call per operation instead of two or more per layer. For an
operation that the copy engine moves whole, `Native.run_layers` goes further: given
its joint runs and each buffer's addresses (`Buffers`, once per pool pair), the C
code computes every layer's addresses itself and makes the same calls as the tape of
that operation would, so Python builds no rows either.

The loop is compiled on first use with the system C compiler (the one Triton uses
for its launchers), from the source below, into the user's cache directory
(`KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier` or `~/.cache/kvtier`). It calls
the runtime through function pointers taken from the `libcudart` the process
already has (`cudart`), so it needs no CUDA headers. Where there is no compiler, or
`KVTIER_NATIVE=0`, `library()` is None and callers submit from Python as before.

Contract: rows run in tape order on the streams they name, exactly as the same
calls made one by one; the first failing call stops the tape and raises
`CudaRuntimeError` naming the row (the rows before it are submitted). Arrays that
a `BATCH` row points to are kept alive by the tape until `run` returns: the
runtime reads them during the call. `run_layers` likewise stops at the first failing
call and names its layer.
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
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvtier.transfer.cudart import MEMCPY_DEFAULT, CudaRuntimeError

log = logging.getLogger(__name__)


class Op(IntEnum):
    """What a tape row does; columns `a..e` follow the runtime call's arguments."""

    COPY = 1  # cudaMemcpyAsync(dst=a, src=b, bytes=c, default kind, stream=d)
    BATCH = 2  # cudaMemcpyBatchAsync(dsts=a, srcs=b, sizes=c, count=d, attrs, stream=e)
    RECORD = 3  # cudaEventRecord(event=a, stream=b)
    WAIT = 4  # cudaStreamWaitEvent(stream=a, event=b, 0)


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

/* Run `n` rows of 6 int64 (op, a, b, c, d, e) in order; 0, or the first error with its row. */
int kvtier_run_tape(const kvtier_runtime *rt, const int64_t *rows, int64_t n, int64_t *failed_row) {
    size_t attrs_index = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *r = rows + 6 * i;
        int err;
        switch (r[0]) {
        case 1: err = rt->copy(P(r[1]), P(r[2]), (size_t)r[3], (int)rt->copy_kind, P(r[4])); break;
        case 2:
            err = rt->batch ? rt->batch((void **)P(r[1]), (void **)P(r[2]), (size_t *)P(r[3]), (size_t)r[4],
                                        rt->attrs, &attrs_index, 1, P(r[5]))
                            : -1;
            break;
        case 3: err = rt->record(P(r[1]), P(r[2])); break;
        case 4: err = rt->wait(P(r[1]), P(r[2]), 0); break;
        default: err = -2;
        }
        if (err) {
            *failed_row = i;
            return err;
        }
    }
    return 0;
}

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

/* The int64 arguments of kvtier_run_layers, in order (see `Native.run_layers`). */
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


class LayerRows(NamedTuple):
    """Tape rows of every layer at once: `rows` `[N, 6]` int64 grouped by `layer` `[N]` (ascending),
    and the arrays their `BATCH` rows point into (`keep`, alive as long as the rows)."""

    rows: np.ndarray
    layer: np.ndarray
    keep: tuple[np.ndarray, ...] = ()


class Tape:
    """Runtime calls to make in order (see the module docstring); build, then `run` once."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []
        self._rows: list[tuple[int, int, int, int, int, int]] = []  # not yet in a block
        self._keep: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(b) for b in self._blocks) + len(self._rows)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._rows.append((Op.COPY, dst, src, nbytes, stream, 0))

    def copies(self, flat: list[int], stream: int) -> None:
        """`flat`: `[dst, src, bytes, dst, src, bytes, ...]` (as `LayerCopies.flat`)."""
        for i in range(0, len(flat), 3):
            self._rows.append((Op.COPY, flat[i], flat[i + 1], flat[i + 2], stream, 0))

    def batch(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """One batched copy of `[n]` raw addresses and byte counts (int64; kept alive by the tape)."""
        d, s, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes))
        self._keep += (d, s, n)
        self._rows.append((Op.BATCH, d.ctypes.data, s.ctypes.data, n.ctypes.data, len(n), stream))

    def record(self, event: int, stream: int) -> None:
        self._rows.append((Op.RECORD, event, stream, 0, 0, 0))

    def wait(self, stream: int, event: int) -> None:
        self._rows.append((Op.WAIT, stream, event, 0, 0, 0))

    def layers(self, table: LayerRows, events: list[int], stream: int) -> None:
        """`table`'s rows with an event record on `stream` after each layer's rows.

        `events`: one handle per layer (`layer` in `[0, len(events))`), or a single one
        recorded after every row. No Python loop per layer or row.
        """
        self._flush()
        self._keep += table.keep
        n = len(table.rows)
        if len(events) == 1:
            self._blocks += [table.rows, np.array([[Op.RECORD, events[0], stream, 0, 0, 0]], dtype=np.int64)]
            return
        count = len(events)
        records = np.zeros((count, 6), dtype=np.int64)
        records[:, 0], records[:, 1], records[:, 2] = Op.RECORD, events, stream
        # Layer i's record goes after every row of layers <= i and the i records before it.
        at = np.searchsorted(table.layer, np.arange(count), side="right") + np.arange(count)
        out = np.empty((n + count, 6), dtype=np.int64)
        is_record = np.zeros(n + count, dtype=bool)
        is_record[at] = True
        out[at], out[~is_record] = records, table.rows
        self._blocks.append(out)

    def rows(self) -> np.ndarray:
        """`[n, 6]` int64: the rows as the compiled loop reads them."""
        self._flush()
        if not self._blocks:
            return np.empty((0, 6), dtype=np.int64)
        return self._blocks[0] if len(self._blocks) == 1 else np.concatenate(self._blocks)

    def _flush(self) -> None:
        if self._rows:
            self._blocks.append(np.array(self._rows, dtype=np.int64).reshape(-1, 6))
            self._rows = []

    def run(self, lib: Native | None) -> None:
        """Make every call in order (no host sync); `CudaRuntimeError` on the first failure."""
        rows = self.rows()
        if not len(rows):
            return
        if lib is None:
            raise ValueError("a tape with calls needs the compiled loop (`library()`)")
        failed = ctypes.c_int64(-1)
        err = lib.run(rows.ctypes.data, len(rows), ctypes.byref(failed))
        if err:
            code = int(rows[failed.value, 0])
            name = Op(code).name if code in Op._value2member_map_ else f"op {code}"
            raise CudaRuntimeError(f"tape row {failed.value} ({name}) failed: CUDA error {err}")


class Buffers:
    """Every buffer of a pool pair as `kvtier_run_layers` addresses its rows (built once per pair).

    One entry per buffer: `(row bytes, (region slots, page, page rows), host [layers of the
    buffer, regions] int64 region addresses, device [layers of the buffer] int64 layer
    addresses, the buffer's model layers)`; `layers`: the model's layer count.
    """

    class _Row(ctypes.Structure):
        _fields_ = [
            *((f, ctypes.c_int64) for f in ("row_bytes", "region_slots", "page", "page_rows", "regions")),
            *((f, ctypes.c_void_p) for f in ("host", "device", "local")),
        ]

    def __init__(
        self,
        buffers: list[tuple[int, tuple[int, int, int], np.ndarray, np.ndarray, list[int]]],
        layers: int,
    ) -> None:
        self.layers = layers
        self._keep: list[np.ndarray] = []
        self._rows = (self._Row * len(buffers))()
        for row, (row_bytes, (region_slots, page, page_rows), host, device, on) in zip(
            self._rows, buffers, strict=True
        ):
            host, device = (np.ascontiguousarray(a, dtype=np.int64) for a in (host, device))
            local = np.full(layers, -1, dtype=np.int64)
            local[on] = np.arange(len(on))
            if host.shape[0] != len(on) or device.shape != (len(on),):
                raise ValueError(f"a buffer on {len(on)} layers has host {host.shape}, device {device.shape}")
            self._keep += (host, device, local)
            row.row_bytes, row.regions = row_bytes, host.shape[1]
            row.region_slots, row.page, row.page_rows = region_slots, page, page_rows
            row.host, row.device, row.local = host.ctypes.data, device.ctypes.data, local.ctypes.data
        self.address = ctypes.addressof(self._rows)
        self.count = len(buffers)


# `kvtier_run_layers`' own failures (the C enum), made before any runtime call.
_LOOP_ERRORS = {-1: "the runs need the batched copy call, which the runtime lacks", -3: "out of host memory"}


class _Runtime(ctypes.Structure):
    """`kvtier_runtime`: the runtime's entry points, bound once and read by both loops."""

    _fields_ = [
        *((f, ctypes.c_void_p) for f in ("copy", "batch", "record", "wait", "attrs")),
        ("copy_kind", ctypes.c_int64),
    ]


class Native:
    """The compiled loops bound to a runtime's entry points (addresses as ints; 0 for a missing batch)."""

    def __init__(
        self, lib: ctypes.CDLL, copy: int, batch: int, record: int, wait: int, attrs: int = 0
    ) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn = lib.kvtier_run_tape
        fn.argtypes = [ptr, ptr, i64, ptr]
        fn.restype = ctypes.c_int
        layers = lib.kvtier_run_layers
        layers.argtypes = [ptr, ptr, ptr]
        layers.restype = ctypes.c_int
        self._fn, self._layers, self._lib = fn, layers, lib
        self._runtime = _Runtime(copy, batch or None, record, wait, attrs or None, MEMCPY_DEFAULT)
        self._runtime_address = ctypes.addressof(self._runtime)
        self.has_batch = bool(batch)

    def run(self, rows: int, n: int, failed) -> int:
        return self._fn(self._runtime_address, rows, n, failed)

    def run_layers(
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

        `runs`: `[3, n]` int64 C-contiguous: first host slot, first device slot and length
        of each joint run (host runs within one segment). `events`: one raw event handle
        per model layer, or one for the end. `order`: `(event, stream)` handles; the copies
        wait for the work queued on that stream first. Buffers with more than `small` runs
        take one batched call per layer (the runtime's batch call must be bound).
        No host sync; `CudaRuntimeError` naming the layer on the first failure.
        """
        if len(events) not in (1, buffers.layers):
            raise ValueError(f"{len(events)} events for {buffers.layers} layers (one per layer, or one)")
        if runs.dtype != np.int64 or runs.ndim != 2 or len(runs) != 3 or not runs.flags.c_contiguous:
            raise ValueError(f"runs must be [3, n] C-contiguous int64, got {runs.dtype} {runs.shape}")
        n = runs.shape[1]
        if n > small and not self.has_batch:
            raise ValueError(f"{n} runs need the batched copy call, which this runtime lacks")
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
    """The compiled loop, built once per source and cached; None without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.info("no C compiler found: transfers are submitted from Python")
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    out_dir = cache_dir or _cache_dir()
    target = out_dir / f"kvtier_tape_{digest}.so"
    if not target.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "tape.c"
                src.write_text(SOURCE)
                built = Path(tmp) / target.name
                subprocess.run(
                    [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(src)],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: concurrent builders each install a whole file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("could not compile the submission loop (%s %s)", e, detail.decode(errors="replace"))
            return None
    return ctypes.CDLL(str(target))


def _cache_dir() -> Path:
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


_native: Native | None = None
_probed = False


def library() -> Native | None:
    """The loop bound to the process's CUDA runtime, or None (no runtime, no compiler, or disabled)."""
    global _native, _probed
    if _probed:
        return _native
    _probed = True
    if os.environ.get("KVTIER_NATIVE", "1") == "0":
        return None
    from kvtier.transfer import cudart, dma

    rt = cudart.runtime()
    if rt is None:
        return None
    lib = compile_library()
    if lib is None:
        return None
    addr = _address
    batch = dma.direct_batch_fn()
    _native = Native(
        lib,
        addr(rt.memcpy_async),
        addr(batch[0]) if batch is not None else 0,
        addr(rt.event_record),
        addr(rt.stream_wait_event),
        batch[1] if batch is not None else 0,
    )
    log.info("transfers submitted from a compiled loop (%s)", lib._name)
    return _native


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value
