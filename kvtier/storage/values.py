"""One self-describing value per page: what is written to storage and checked when read back.

Layout (little-endian):

    magic "KVTP" | version u16 | compression u8 | 0 u8 | tokens u32 | buffers u32 |
    payload bytes u64 | xxh3-64 of the payload u64 | fingerprint 16 B | page hash 32 B |
    raw bytes of each buffer u64 x buffers | payload

The raw payload is the page's bytes buffer by buffer in the spec's order; within a buffer,
layer by layer, each layer's `page_size` rows (so a `page_first` host page of a buffer is
one stretch, and a `layer_first` one a stretch per layer). Compressed (`lz4`, `zstd`), the
payload is each buffer's bytes split into byte planes (byte 0 of every element, then byte
1, ...), concatenated and compressed as one frame; a page that does not shrink is stored
raw. A reader decodes either kind, whatever its own setting.

`PageCodec.check` refuses a value (returns why, a `REJECTIONS` name) unless every field
matches what the reader expects, the length is exact and the checksum holds: a refused
value is a miss, never KV. A `get_into` length of -1 is `ABSENT` (not a refusal) unless the
backend named the value's source, which says it found a value too long for the buffers:
refused as `oversize`. A refused value read into `read_buffers` is also deleted from its
backend where the backend can (`ValueBuffers.discard`; `discarded` says whether it was):
the next store of the page writes it again. Nothing here raises for a bad value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from kvtier.spec import KVSpec
from kvtier.storage.backend import ValueBuffers
from kvtier.storage.config import Compression
from kvtier.storage.keys import Fingerprint

MAGIC = b"KVTP"
# What `check` says of a key with no value: a miss, not a refusal.
ABSENT = "absent"
VERSION = 1
_FIXED = struct.Struct("<4sHBBIIQQ16s32s")
_CODES = {Compression.NONE: 0, Compression.LZ4: 1, Compression.ZSTD: 2}
_NAMES = {v: k for k, v in _CODES.items()}


class PageCodec:
    """Encodes and checks the values of one spec's pages under one fingerprint; thread-safe."""

    def __init__(self, spec: KVSpec, fingerprint: Fingerprint, compression: Compression = Compression.NONE):
        self.spec, self.fingerprint = spec, fingerprint
        self.compression = Compression(compression)
        ps = spec.page_size
        self.buffer_bytes = [ps * b.bytes_per_token() for b in spec.buffers]
        self.itemsizes = [b.dtype.itemsize for b in spec.buffers]
        self.payload_bytes = sum(self.buffer_bytes)
        self._lengths = struct.pack(f"<{len(self.buffer_bytes)}Q", *self.buffer_bytes)
        self.header_bytes = _FIXED.size + len(self._lengths)
        self.value_bytes = self.header_bytes + self.payload_bytes  # the longest value, raw

    # -- writing -----------------------------------------------------------------------

    def encode(self, page_hash: bytes, views: Sequence[memoryview]) -> list[memoryview | bytes]:
        """The value of one page as chunks (header, then the payload), from the page's `views`.

        `views`: the page's raw payload in order (`PageViews`), uint8 memoryviews.
        """
        if self.compression is not Compression.NONE:
            packed = _compress(self.compression, self._planes(views))
            if len(packed) < self.payload_bytes:
                return [self._header(page_hash, self.compression, packed, [packed]), packed]
        return [self._header(page_hash, Compression.NONE, None, views), *views]

    def _header(self, page_hash: bytes, kind: Compression, packed, chunks) -> bytes:
        h = xxhash.xxh3_64()
        for c in chunks:
            h.update(c)
        n = len(packed) if packed is not None else self.payload_bytes
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            _CODES[kind],
            0,
            self.spec.page_size,
            len(self.buffer_bytes),
            n,
            h.intdigest(),
            self.fingerprint.digest,
            page_hash,
        )
        return fixed + self._lengths

    def _planes(self, views: Sequence[memoryview]) -> bytes:
        raw = np.concatenate([np.frombuffer(v, dtype=np.uint8) for v in views])
        parts, at = [], 0
        for n, size in zip(self.buffer_bytes, self.itemsizes, strict=True):
            part = raw[at : at + n]
            parts.append(part if size == 1 else part.reshape(-1, size).T.ravel())
            at += n
        return b"".join(p.tobytes() for p in parts)

    # -- reading -----------------------------------------------------------------------

    def read_buffers(self, views: Sequence[memoryview]) -> ValueBuffers:
        """Where a backend's `get_into` writes one value: a header buffer, then the page's `views`."""
        return ValueBuffers([memoryview(bytearray(self.header_bytes)), *views])

    def check(self, page_hash: bytes, length: int, buffers: Sequence[memoryview]) -> str | None:
        """Verify a value read into `buffers` (from `read_buffers`); None when the page's views hold it.

        A compressed value is decompressed into the views here. Returns the `REJECTIONS`
        reason of a refused value, which is then discarded from its backend, or `ABSENT` (see
        the module docstring); `length` is what `get_into` returned.
        """
        if length < 0:  # a value too long for its buffers where the backend says it found one
            found = isinstance(buffers, ValueBuffers) and buffers.source is not None
            why = "oversize" if found else ABSENT
        else:
            why = self._check(page_hash, length, buffers)
        if why is not None and isinstance(buffers, ValueBuffers):
            buffers.discard()
        return why

    def _check(self, page_hash: bytes, length: int, buffers: Sequence[memoryview]) -> str | None:
        header = buffers[0]
        if length < self.header_bytes:
            return "truncated"
        magic, version, code, _, tokens, nbuf, n, checksum, fp, ph = _FIXED.unpack_from(header)
        if magic != MAGIC or version != VERSION or code not in _NAMES or nbuf != len(self.buffer_bytes):
            return "header"
        if bytes(header[_FIXED.size :]) != self._lengths:
            return "header"
        if fp != self.fingerprint.digest:
            return "fingerprint"
        if ph != page_hash or tokens != self.spec.page_size:
            return "tokens"
        if length != self.header_bytes + n:
            return "truncated"
        views = buffers[1:]
        kind = _NAMES[code]
        if kind is Compression.NONE:
            if n != self.payload_bytes:
                return "header"
            h = xxhash.xxh3_64()
            for v in views:
                h.update(v)
            return None if h.intdigest() == checksum else "checksum"
        packed = b"".join(bytes(v) for v in views)[:n]  # copied out: the views are overwritten below
        if xxhash.xxh3_64_intdigest(packed) != checksum:
            return "checksum"
        try:
            planes = _decompress(kind, packed, self.payload_bytes)
        except Exception:  # a corrupt frame whose checksum collided, or a codec missing here
            return "checksum"
        if len(planes) != self.payload_bytes:
            return "truncated"
        self._unplane(planes, views)
        return None

    def _unplane(self, planes: bytes, views: Sequence[memoryview]) -> None:
        src = np.frombuffer(planes, dtype=np.uint8)
        parts, at = [], 0
        for n, size in zip(self.buffer_bytes, self.itemsizes, strict=True):
            part = src[at : at + n]
            parts.append(part if size == 1 else part.reshape(size, -1).T.ravel())
            at += n
        raw = np.concatenate(parts)
        at = 0
        for v in views:
            dst = np.frombuffer(v, dtype=np.uint8)
            dst[:] = raw[at : at + len(dst)]
            at += len(dst)


def _compress(kind: Compression, data: bytes) -> bytes:
    if kind is Compression.LZ4:
        import lz4.frame

        return lz4.frame.compress(data)
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(data)


def _decompress(kind: Compression, data: bytes, size: int) -> bytes:
    if kind is Compression.LZ4:
        import lz4.frame

        return lz4.frame.decompress(data)
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
