"""The streams a layer's transfer runs on beside the caller's, and which staging bytes are still read.

- `side_stream(stream)`: a layer's direct kernel parts (`phases`), forked from and joined into `stream`;
- `pass_stream(stream)`: a staged part's device passes where its buffers lie apart in the staging
  buffer: a load's `index_copy_` while the next buffer's rows arrive on `stream`, a backup's
  `index_select` while the buffer before it is copied out on `stream`.

Both are made on first use, one per caller's stream, of its device and priority, and kept. Keys are
CUDA stream handles, which torch draws from a fixed pool per device and priority, so the tables stay
small; a side stream that is also some caller's stream only costs that pair its overlap (every wait
is an event).

Staging places: a call starts with `begin` (the pass stream waits for everything queued on the
caller's stream so far, and nothing is left pending). Before one stream writes staging bytes the
other still reads, it waits for that read (`reuse`; `reading` notes a read: a load's pass, a
backup's copies out); `join` ends a layer (the caller's stream waits for the pass stream). A
backup's reads stay pending across its layers, since the next layer's passes write the same places.
Contract: one caller's stream is used from one thread at a time.
"""

from __future__ import annotations

import threading

import torch

_Streams = dict[tuple[int, int], torch.cuda.Stream]
_sides: _Streams = {}
_passes: _Streams = {}
_lock = threading.Lock()
# Per caller's stream (its handle): staging bytes `[start, end)` a queued pass reads, and its event.
_reading: dict[int, list[tuple[int, int, torch.cuda.Event]]] = {}


def side_stream(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The second stream of `stream`, for its layers' direct kernel parts."""
    return _stream_of(_sides, stream)


def pass_stream(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The stream `stream`'s staged device passes run on beside its copies."""
    return _stream_of(_passes, stream)


def _stream_of(table: _Streams, stream: torch.cuda.Stream) -> torch.cuda.Stream:
    key = (stream.device.index, stream.cuda_stream)
    with _lock:
        other = table.get(key)
        if other is None:
            other = table[key] = torch.cuda.Stream(stream.device, priority=stream.priority)
        return other


def begin(stream: torch.cuda.Stream, passes: torch.cuda.Stream) -> None:
    """The start of a call on `stream`: its passes come after what `stream` has queued, none pending."""
    passes.wait_stream(stream)
    _reading.pop(stream.cuda_stream, None)


def reading(stream: torch.cuda.Stream, place: tuple[int, int], reader: torch.cuda.Stream) -> None:
    """What was just queued on `reader` (the pass stream, or `stream` itself) for `stream`'s call reads
    staging bytes `place` (`[start, end)`)."""
    read = torch.cuda.Event()
    read.record(reader)
    _reading.setdefault(stream.cuda_stream, []).append((*place, read))


def reuse(stream: torch.cuda.Stream, place: tuple[int, int], writer: torch.cuda.Stream | None = None) -> None:
    """`writer` (default `stream`) waits for every read noted for `stream`'s call of staging bytes
    overlapping `place` (before it writes there)."""
    writer = writer or stream
    pending = _reading.get(stream.cuda_stream, [])
    keep = []
    for start, end, read in pending:
        if start < place[1] and place[0] < end:
            writer.wait_event(read)
        else:
            keep.append((start, end, read))
    pending[:] = keep


def join(stream: torch.cuda.Stream, passes: torch.cuda.Stream) -> None:
    """The end of a layer: `stream` waits for its passes (reads noted stay pending: `begin`)."""
    stream.wait_stream(passes)
