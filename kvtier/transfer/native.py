"""One foreign call that submits a whole operation: the compiled loop.

A reload's few runtime calls a layer (copies, kernel launch, event) cost from Python several times
the driver's work (bench/FINDINGS.md): `kvtier_run_layers` computes every layer's addresses in C
and makes the calls, layer l on the l-th of the operation's streams, from what `loop` builds. It is
compiled on first use with the system C compiler into the user's cache directory and calls the
process's `libcudart` and `cuLaunchKernel` through pointers; without a compiler, or with
`KVTIER_NATIVE=0`, `library()` is None and callers use the plan executor.

An operation of many copies is made from a thread of the loop's own (`Native.run` with a device:
a `Job`), the caller's thread returning at once; the job says which layers' events are recorded.

Contract: the calls are made in order per stream, exactly as the same calls made one by one; the
first failing call stops the loop and raises `CudaRuntimeError` naming its layer (a job's, from
`Job.recorded` and `Job.finish`). The C source is `loop.c`, beside this module.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier import paths
from kvtier.errors import ConfigError, CudaRuntimeError
from kvtier.transfer import compiled, cudart
from kvtier.transfer.cudart import MEMCPY_DEFAULT

log = logging.getLogger(__name__)


SOURCE = (Path(__file__).parent / "loop.c").read_text()


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
        ("set_device", ctypes.c_void_p),
    ]


def _error(err: int, failed: int, layers: int) -> CudaRuntimeError | None:
    """The loop's result `err` (failing at layer `failed` of `layers`) as an error, or None."""
    if err in _LOOP_ERRORS:
        return CudaRuntimeError(f"the compiled loop failed before any call: {_LOOP_ERRORS[err]}")
    if not err:
        return None
    where = {-2: "setting the device of its thread", -1: "ordering after the compute stream"}
    where[layers] = "joining its streams"
    return CudaRuntimeError(f"moving rows failed at {where.get(failed, f'layer {failed}')}: CUDA error {err}")


class Native:
    """The compiled loop bound to a runtime's entry points (addresses as ints; 0 for a missing batch
    call, kernel launch or device setter). `kernel`: how a `RowLaunch` becomes a launch the loop can
    make (`compiled.find`; tests pass a stand-in), used only with `launch`."""

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
        set_device: int = 0,
    ) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._layers, self._start = lib.kvtier_run_layers, lib.kvtier_start
        self._wait, self._finish = lib.kvtier_wait, lib.kvtier_finish
        for fn, args, out in (
            (self._layers, [ptr, ptr, ptr], ctypes.c_int),
            (self._start, [ptr, ptr, i64], ptr),
            (self._wait, [ptr, i64], i64),
            (self._finish, [ptr, ptr], ctypes.c_int),
        ):
            fn.argtypes, fn.restype = args, out
        self._lib = lib
        entries = (copy, batch or None, record, wait, launch or None, attrs or None)
        self._runtime = _Runtime(*entries, MEMCPY_DEFAULT, set_device or None)
        self._runtime_address = ctypes.addressof(self._runtime)
        self.has_batch = bool(batch)
        self.kernel = kernel if launch else None

    def run(self, work: int, buffers: int, count: int, layers: int, load: bool, events: list[int],
            streams: list[int], forks: list[int], order: tuple[int, int] | None,
            small: int, device: int | None = None) -> Job | None:  # fmt: skip
        """Make the calls of an operation (see the C source): `work`, `buffers`, the addresses of
        `count` work and buffer structures; `events`: one raw event handle per model layer, or one for
        the end; `streams`: raw stream handles (layer l on streams[l % k]); `forks`: one raw event per
        stream; `order`: `(event, stream)` handles the first stream waits behind. With `device`, on a
        thread of its own on that device: the `Job` (None where no thread started and nothing was
        called); the caller keeps what `work` and `buffers` point into until the job is finished."""
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
        if device is not None:
            handle = self._start(self._runtime_address, args.buffer_info()[0], device)
            return (
                Job(self._wait, self._finish, handle, layers, len(events), [handles, self])
                if handle
                else None
            )
        failed = ctypes.c_int64(-1)
        error = _error(
            self._layers(self._runtime_address, args.buffer_info()[0], ctypes.byref(failed)),
            failed.value,
            layers,
        )
        if error is not None:
            raise error
        return None


class Job:
    """An operation the loop makes on a thread of its own (`Native.run` with a device): signal i of
    `signals` is `recorded(i)` once its event is (the last one once the loop is done); `finish()`
    waits for the loop and frees it. `keep`: what the loop reads, held until then (callers add to
    it); `RUNNING` holds every job until it is finished."""

    def __init__(self, wait, finish, handle: int, layers: int, signals: int, keep: list) -> None:
        self._wait, self._finish, self._handle = wait, finish, handle
        self.layers, self.signals, self.keep = layers, signals, keep
        self.error: CudaRuntimeError | None = None
        self._lock = threading.Lock()
        RUNNING.add(self)

    def recorded(self, i: int, wait: bool = False) -> bool:
        """Whether signal `i`'s event is recorded (`wait`: block until it is); raises the loop's error
        once it failed."""
        with self._lock:
            if self._handle is not None:
                want = i + 1 if i < self.signals - 1 else 1 << 62
                got = self._wait(self._handle, want if wait else 0)  # the foreign call lets go of the GIL
                if got >= 0:
                    return got >= want
                self._close()
        if self.error is not None:
            raise self.error
        return True

    def finish(self) -> CudaRuntimeError | None:
        """Wait until the loop has made its calls and free it: its error (logged), or None."""
        with self._lock:
            self._close()
        return self.error

    def _close(self) -> None:
        if self._handle is not None:
            failed = ctypes.c_int64(-1)
            err = self._finish(self._handle, ctypes.byref(failed))
            self._handle, self.keep = None, []
            self.error = _error(err, failed.value, self.layers)
            RUNNING.discard(self)
            if self.error is not None:
                log.error("a transfer submitted from its own thread failed: %s", self.error)


RUNNING: set[Job] = set()
atexit.register(lambda: [job.finish() for job in list(RUNNING)])  # no thread calls CUDA past exit


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
                cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(built), str(src)]
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
    native = Native(
        lib, *(_address(fn) for fn in entries), attrs, launch, compiled.find, _address(rt.set_device)
    )
    log.info("transfers submitted from a compiled loop (%s)", lib._name)
    return native


# The loop of this process, found once (`cudart.Probed`: tests pin a stand-in with `set`).
LIBRARY: cudart.Probed[Native | None] = cudart.Probed(_find_library)


def library() -> Native | None:
    """The loop bound to the process's CUDA runtime, or None (no runtime, no compiler, or disabled)."""
    return LIBRARY.get()


def _address(fn) -> int:
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
