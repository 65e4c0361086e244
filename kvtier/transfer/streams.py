"""The streams a layer's transfer runs on beside the caller's, and what the staging buffer's device
passes still read.

- `side_stream(stream)`: a layer's direct kernel parts (`phases`), forked from and joined into `stream`;
- `pass_stream(stream)`: a load's staged device passes (`index_copy_`) where its buffers lie apart in
  the staging buffer, so the next buffer's rows arrive on `stream` meanwhile.

Both are made on first use, one per caller's stream, of its device and priority, and kept. Keys are
CUDA stream handles, which torch draws from a fixed pool per device and priority, so the tables stay
small; a side stream that is also some caller's stream only costs that pair its overlap (every wait
is an event).

Staging places: before `stream` writes staging bytes a queued pass still reads, it waits for that
pass (`reuse`); `reading` notes a pass, `join` ends a layer (the caller's stream waits for the pass
stream, and nothing is left pending). Contract: one caller's stream is used from one thread at a time.
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


def reading(stream: torch.cuda.Stream, place: tuple[int, int], passes: torch.cuda.Stream) -> None:
    """The pass just queued on `passes` for `stream`'s layer reads staging bytes `place` (`[start, end)`)."""
    read = torch.cuda.Event()
    read.record(passes)
    _reading.setdefault(stream.cuda_stream, []).append((*place, read))


def reuse(stream: torch.cuda.Stream, place: tuple[int, int]) -> None:
    """`stream` waits for every queued pass that reads staging bytes overlapping `place` (before it
    writes there)."""
    pending = _reading.get(stream.cuda_stream, [])
    keep = []
    for start, end, read in pending:
        if start < place[1] and place[0] < end:
            stream.wait_event(read)
        else:
            keep.append((start, end, read))
    pending[:] = keep


def join(stream: torch.cuda.Stream, passes: torch.cuda.Stream) -> None:
    """The end of a layer: `stream` waits for its passes, none left pending."""
    stream.wait_stream(passes)
    _reading.pop(stream.cuda_stream, None)
