"""One foreign call that submits a whole operation: the compiled loop.

A reload's few runtime calls a layer (copies, kernel launch, event) cost from Python several times
the driver's work (bench/FINDINGS.md): `kvtier_run_layers` computes every layer's addresses in C
and makes the calls, layer l on the l-th of the operation's streams, from what `loop` builds. It is
compiled on first use with the system C compiler into the user's cache directory and calls the
process's `libcudart` and `cuLaunchKernel` through pointers; without a compiler, or with
`KVTIER_NATIVE=0`, `library()` is None and callers use the plan executor.

Contract: the calls are made in order per stream, exactly as the same calls made one by one; the
first failing call stops the loop and raises `CudaRuntimeError` naming its layer.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier import paths
from kvtier.errors import ConfigError, CudaRuntimeError
from kvtier.transfer import compiled, cudart
from kvtier.transfer.cudart import MEMCPY_DEFAULT

log = logging.getLogger(__name__)


SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef int (*copy_fn)(void *, const void *, size_t, int, void *);
typedef int (*batch_fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         void *, void **, void **);

#define P(x) ((void *)(intptr_t)(x))

/* The runtime's entry points, as `Native` binds them once (`launch`: the driver's cuLaunchKernel). */
typedef struct {
    copy_fn copy;
    batch_fn batch; /* NULL where the runtime has none */
    record_fn record;
    wait_fn wait;
    launch_fn launch; /* NULL where no kernel can be launched from here */
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

/* One compiled launch of the row kernel: parameters (src, src offsets, dst, dst offsets, n, row
   vectors) then `extra` null pointers; n and the row vectors take `n_bytes` and `vecs_bytes`
   bytes (4 or 8; 0: folded into the kernel as a constant). */
typedef struct {
    void *func;
    int64_t grid, threads, shared, src_off, dst_off, n, row_vecs, n_bytes, vecs_bytes, extra;
} kvtier_launch;

/* One buffer's share of an operation: `n_runs` copies (`runs` [3, n_runs]: first host slot, first
   device slot, length) and, where `launches` is set, one launch a layer, launches[layer_class[j]]
   on buffer layer j, from the layer's first host region (load: host -> device). */
typedef struct {
    const int64_t *runs;
    int64_t n_runs;
    const kvtier_launch *launches;
    const int64_t *layer_class;
} kvtier_work;

/* The int64 arguments of kvtier_run_layers, in order (see `Native.run`). */
enum { WORK, BUFS, N_BUFS, LAYERS, LOAD, EVENTS, N_EVENTS, STREAMS, N_STREAMS, FORKS, ORDER_EVENT,
       ORDER_STREAM, SMALL };
/* Its own failures, before any runtime call (runtime errors are positive). */
enum { NO_BATCH = -1, NO_MEMORY = -3, NO_LAUNCH = -4 };

static void *param(int64_t bytes, int64_t *wide, int32_t *narrow) {
    *narrow = (int32_t)*wide;
    return bytes == 4 ? (void *)narrow : (void *)wide;
}

static int launch_rows(const kvtier_runtime *rt, const kvtier_launch *k, int64_t src, int64_t dst, void *st) {
    int64_t s = src, d = dst, so = k->src_off, dof = k->dst_off, n = k->n, v = k->row_vecs;
    int32_t n32, v32;
    void *null = NULL, *params[16];
    int p = 0;
    params[p++] = &s, params[p++] = &so, params[p++] = &d, params[p++] = &dof;
    params[p++] = param(k->n_bytes, &n, &n32);
    if (k->vecs_bytes) params[p++] = param(k->vecs_bytes, &v, &v32);
    for (int64_t e = 0; e < k->extra && p < 16; e++) params[p++] = &null;
    unsigned grid = (unsigned)k->grid, threads = (unsigned)k->threads, shared = (unsigned)k->shared;
    return rt->launch(k->func, grid, 1, 1, threads, 1, 1, shared, st, params, NULL);
}

/* Move every buffer's work on every model layer. Layer l goes on streams[l % n_streams]; first,
   streams[0] waits for the work queued on `order_stream` (when `order_event` is set) and the
   other streams for streams[0] (forks[0]); at the end they join it (forks[s]). events[l] is
   recorded after layer l (one event: after the last layer); the last is recorded on streams[0]
   after the join. A buffer with more than `small` runs takes one batched call per layer. 0, or the
   first error and its layer (-1: the ordering calls, `layers`: the join and the last record). */
int kvtier_run_layers(const kvtier_runtime *rt, const int64_t *args, int64_t *failed_layer) {
    const kvtier_work *work = (const kvtier_work *)P(args[WORK]);
    const kvtier_buffer *bufs = (const kvtier_buffer *)P(args[BUFS]);
    const int64_t *events = (const int64_t *)P(args[EVENTS]), *streams = (const int64_t *)P(args[STREAMS]);
    const int64_t *forks = (const int64_t *)P(args[FORKS]);
    int64_t n_bufs = args[N_BUFS], layers = args[LAYERS], n_events = args[N_EVENTS], k = args[N_STREAMS];
    int64_t small = args[SMALL], most = 0;
    int load = (int)args[LOAD];
    void *order_event = P(args[ORDER_EVENT]), *main = P(streams[0]);
    record_fn record = rt->record;
    wait_fn wait = rt->wait;
    int err = 0;
    int64_t *scratch = NULL; /* a batched call's dst [n], src [n], bytes [n] */
    *failed_layer = -1;
    for (int64_t b = 0; b < n_bufs; b++) { /* before any call, so a failure here submits nothing */
        if (work[b].launches && !rt->launch) return NO_LAUNCH;
        if (work[b].n_runs > small && work[b].n_runs > most) most = work[b].n_runs;
    }
    if (most && !rt->batch) return NO_BATCH;
    if (most && !(scratch = malloc(3 * most * sizeof(int64_t)))) return NO_MEMORY;
    if (order_event && !(err = record(order_event, P(args[ORDER_STREAM])))) err = wait(main, order_event, 0);
    if (k > 1 && !err) err = record(P(forks[0]), main);
    for (int64_t s = 1; s < k && !err; s++) err = wait(P(streams[s]), P(forks[0]), 0);
    for (int64_t l = 0; l < layers && !err; l++) {
        void *stream = P(streams[l % k]);
        *failed_layer = l;
        for (int64_t b = 0; b < n_bufs && !err; b++) {
            const kvtier_buffer *f = bufs + b;
            const kvtier_work *w = work + b;
            const int64_t *runs = w->runs;
            int64_t j = f->local[l], n = w->n_runs;
            if (j < 0) continue;
            const int64_t *host = f->host + j * f->regions;
            int64_t dev = f->device[j], rb = f->row_bytes;
            for (int64_t r = 0; r < n && !err; r++) {
                int64_t h = runs[r], region = h / f->region_slots, rel = h - region * f->region_slots;
                int64_t ha = host[region] + ((rel / f->page) * f->page_rows + rel % f->page) * rb;
                int64_t da = dev + runs[n + r] * rb, bytes = runs[2 * n + r] * rb;
                int64_t dst = load ? da : ha, src = load ? ha : da;
                if (n > small) {
                    scratch[r] = dst, scratch[n + r] = src, scratch[2 * n + r] = bytes;
                } else {
                    err = rt->copy(P(dst), P(src), (size_t)bytes, (int)rt->copy_kind, stream);
                }
            }
            if (!err && n > small) {
                size_t attrs_index = 0;
                void **dsts = (void **)scratch, **srcs = (void **)(scratch + n);
                size_t *sizes = (size_t *)(scratch + 2 * n);
                err = rt->batch(dsts, srcs, sizes, (size_t)n, rt->attrs, &attrs_index, 1, stream);
            }
            if (!err && w->launches) {
                const kvtier_launch *kl = w->launches + w->layer_class[j];
                if (kl->grid) err = launch_rows(rt, kl, load ? host[0] : dev, load ? dev : host[0], stream);
            }
        }
        if (!err && n_events == layers && (k == 1 || l < layers - 1)) err = record(P(events[l]), stream);
    }
    if (!err) *failed_layer = layers;
    for (int64_t s = 1; s < k && !err; s++)
        if (!(err = record(P(forks[s]), P(streams[s])))) err = wait(main, P(forks[s]), 0);
    if (!err && (k > 1 || n_events != layers)) err = record(P(events[n_events - 1]), main);
    free(scratch);
    return err;
}
"""


# `kvtier_run_layers`' own failures (the C enum), made before any runtime call.
_LOOP_ERRORS = {
    -1: "the runs need the batched copy call, which the runtime lacks",
    -3: "out of host memory",
    -4: "the work has kernel launches and no launch call was bound",
}


class _Runtime(ctypes.Structure):
    """`kvtier_runtime`: the runtime's entry points, bound once and read by the loop."""

    _fields_ = [
        *((f, ctypes.c_void_p) for f in ("copy", "batch", "record", "wait", "launch", "attrs")),
        ("copy_kind", ctypes.c_int64),
    ]


class Native:
    """The compiled loop bound to a runtime's entry points (addresses as ints; 0 for a missing batch
    call or kernel launch). `kernel`: how a `RowLaunch` becomes a launch the loop can make
    (`compiled.find`; tests pass a stand-in), used only with `launch`."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        copy: int,
        batch: int,
        record: int,
        wait: int,
        attrs: int = 0,
        launch: int = 0,
        kernel: Callable[..., Any] | None = None,
    ) -> None:
        ptr = ctypes.c_void_p
        layers = lib.kvtier_run_layers
        layers.argtypes = [ptr, ptr, ptr]
        layers.restype = ctypes.c_int
        self._layers, self._lib = layers, lib
        entries = (copy, batch or None, record, wait, launch or None, attrs or None)
        self._runtime = _Runtime(*entries, MEMCPY_DEFAULT)
        self._runtime_address = ctypes.addressof(self._runtime)
        self.has_batch = bool(batch)
        self.kernel = kernel if launch else None

    def run(self, work: int, buffers: int, count: int, layers: int, load: bool, events: list[int],
            streams: list[int], forks: list[int], order: tuple[int, int] | None,
            small: int) -> None:  # fmt: skip
        """Make the calls of an operation (see the C source): `work`, `buffers`, the addresses of
        `count` work and buffer structures; `events`: one raw event handle per model layer, or one for
        the end; `streams`: raw stream handles (layer l on streams[l % k]); `forks`: one raw event per
        stream; `order`: `(event, stream)` handles the first stream waits behind."""
        if len(events) not in (1, layers):
            raise ConfigError(f"{len(events)} events for {layers} layers (one per layer, or one)")
        if not streams or len(forks) < len(streams):
            raise ConfigError(f"{len(streams)} streams need as many fork events, not {len(forks)}")
        handles = array.array("q", (*events, *streams, *forks))  # int64, as the loop reads them
        at = handles.buffer_info()[0]
        order_event, order_stream = order or (0, 0)
        # One int64 array of arguments (the loop's `args`): a foreign call with three arguments
        # costs less than with thirteen, most of all when the process's caches are cold.
        args = array.array(
            "q",
            (
                work, buffers, count, layers, int(load), at, len(events), at + 8 * len(events),
                len(streams), at + 8 * (len(events) + len(streams)), order_event, order_stream, small,
            ),
        )  # fmt: skip
        failed = ctypes.c_int64(-1)
        err = self._layers(self._runtime_address, args.buffer_info()[0], ctypes.byref(failed))
        if err in _LOOP_ERRORS:
            raise CudaRuntimeError(f"the compiled loop failed before any call: {_LOOP_ERRORS[err]}")
        if err:
            where = {-1: "ordering after the compute stream", layers: "joining its streams"}
            at_layer = where.get(failed.value, f"layer {failed.value}")
            raise CudaRuntimeError(f"moving rows failed at {at_layer}: CUDA error {err}")


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
    batch, attrs = cudart.direct_batch_fn() or (None, 0)
    entries = (rt.memcpy_async, batch, rt.event_record, rt.stream_wait_event)
    driver = cudart.driver()
    launch = 0 if driver is None else _address(driver.launch_kernel)
    native = Native(lib, *(_address(fn) for fn in entries), attrs, launch, compiled.find)
    log.info("transfers submitted from a compiled loop (%s)", lib._name)
    return native


# The loop of this process, found once (`cudart.Probed`: tests pin a stand-in with `set`).
LIBRARY: cudart.Probed[Native | None] = cudart.Probed(_find_library)


def library() -> Native | None:
    """The loop bound to the process's CUDA runtime, or None (no runtime, no compiler, or disabled)."""
    return LIBRARY.get()


def _address(fn) -> int:
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
