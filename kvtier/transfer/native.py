"""A whole operation's runtime calls submitted from one compiled loop.

A reload submits two runtime calls per model layer (its copies, then the event that
says the layer is in place). On an H200 host the driver's own work for the pair is
~3 us; from Python through ctypes it cost ~8 us, most of a 128k-token reload's
submission (bench/NOTES.md). A `Tape` collects the calls as rows of integers and
`run` hands the whole tape to a small C loop that makes them in order, so Python
pays one foreign call per operation instead of two or more per layer.

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
runtime reads them during the call.
"""

from __future__ import annotations

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

typedef int (*copy_fn)(void *, const void *, size_t, int, void *);
typedef int (*batch_fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);

#define P(x) ((void *)(intptr_t)(x))

/* Run `n` rows of 6 int64 (op, a, b, c, d, e) in order; 0, or the first error with its row. */
int kvtier_run_tape(const int64_t *rows, int64_t n, copy_fn copy, batch_fn batch, record_fn record,
                    wait_fn wait, void *attrs, int copy_kind, int64_t *failed_row) {
    size_t attrs_index = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *r = rows + 6 * i;
        int err;
        switch (r[0]) {
        case 1: err = copy(P(r[1]), P(r[2]), (size_t)r[3], copy_kind, P(r[4])); break;
        case 2:
            err = batch ? batch((void **)P(r[1]), (void **)P(r[2]), (size_t *)P(r[3]), (size_t)r[4],
                                attrs, &attrs_index, 1, P(r[5]))
                        : -1;
            break;
        case 3: err = record(P(r[1]), P(r[2])); break;
        case 4: err = wait(P(r[1]), P(r[2]), 0); break;
        default: err = -2;
        }
        if (err) {
            *failed_row = i;
            return err;
        }
    }
    return 0;
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


class Native:
    """The compiled loop bound to a runtime's entry points (addresses as ints; 0 for a missing batch)."""

    def __init__(
        self, lib: ctypes.CDLL, copy: int, batch: int, record: int, wait: int, attrs: int = 0
    ) -> None:
        fn = lib.kvtier_run_tape
        ptr = ctypes.c_void_p
        fn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int
        self._fn, self._lib = fn, lib
        self._args = (copy, batch or None, record, wait, attrs or None, MEMCPY_DEFAULT)
        self.has_batch = bool(batch)

    def run(self, rows: int, n: int, failed) -> int:
        copy, batch, record, wait, attrs, kind = self._args
        return self._fn(rows, n, copy, batch, record, wait, attrs, kind, failed)


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
        addr(rt.lib.cudaMemcpyAsync),
        addr(batch[0]) if batch is not None else 0,
        addr(rt.lib.cudaEventRecord),
        addr(rt.lib.cudaStreamWaitEvent),
        batch[1] if batch is not None else 0,
    )
    log.info("transfers submitted from a compiled loop (%s)", lib._name)
    return _native


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value
