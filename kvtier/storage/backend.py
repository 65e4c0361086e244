"""The interface every storage backend implements, and `open_backend(url)` that picks one.

A backend stores opaque values under string keys; it knows nothing of pages, tokens or
checksums (`kvtier.storage.values` makes and checks the values). Every call is batched:

- `exists(keys) -> int`: how many of `keys`, from the first, are present (stops at the
  first absent one; a prefix's pages are asked for in order).
- `get_into(keys, buffers) -> list[int]`: for each key, the value's bytes written into
  that key's buffers in order, as `readv` does (`buffers[i]`: a list of writable
  C-contiguous memoryviews, pinned host slots where the caller has them); the entry is
  the value's length, or `-1` where the key is absent or the value is longer than its
  buffers (nothing of a `-1` value counts as written; a shorter value fills the buffers
  from the start and its length says so). A `-1` is a miss, never an error; the reader
  tells the two kinds apart by the source (below) and makes sure neither stays a miss
  for ever (`kvtier.cache.storage_mover`: a value too long is deleted or written over).
- `put(keys, values) -> list[bool]`: store `values[i]` (a list of byte chunks, written as
  one value in order) under `keys[i]`; True where it was stored. A key written by two
  writers at once ends with one of the two values whole, never a mix.
- `reachable() -> bool` (optional; the default says True): whether the store answers, for
  health checks (`/health`, `/metrics`): cheap where it is, at most one short call where
  the backend must ask (`PROBE_KEY` is a key no value is ever stored under).
- `usage() -> (pages, bytes) | None`: what the backend holds now where it knows (the
  file backend does; a shared server may not), for metrics.
- `discard(keys) -> bool | None` (optional): delete the keys' values (absent ones are no
  error); anything but False means they are gone. A backend that implements it names, in
  `get_into`, where each value it found came from (`note_source(buffers[i], self, key)`,
  for found values only: a `-1` with a source is a value too long, one without is an
  absent key); a reader that refuses the value (`kvtier.storage.values.PageCodec.check`:
  damaged, torn, another model's, too long) then has it discarded (`ValueBuffers.discard`),
  so the page is a miss that the next store writes again, not a key that stays present
  and refused for ever. The default (a backend written before `discard` existed) deletes
  nothing, logs that once per backend and returns False: the reader then has the next
  store write over the value instead of skipping it as present.
- `close()`: release connections and files; idempotent.

Keys are 1-200 characters of `[A-Za-z0-9._-]` (`check_keys`; kvtier's are
`<fingerprint>.<page hash>` in hex), so any backend may use them as file or object names;
`byte_views` flattens a value's chunks or a key's buffers into byte memoryviews.

Errors: a backend may raise `StorageError` (or any exception) from a call; the storage tier
catches it, counts it under the call's operation, logs it and treats the call's keys as
misses or writes not stored. A backend never needs to retry: the tier calls again later.
A backend may be called from several threads at once.

`open_backend(url, **options)`:
- `file://PATH` (`FileBackend`, the default tier below the host), options `size_bytes`;
- `redis://HOST:PORT[/DB]`, `redis+cluster://HOST:PORT[,HOST:PORT...]` (`RedisBackend`),
  options `pool_size`, `ttl_s`, `timeout_s`;
- `MODULE:CLASS[?key=value&...]`: a third-party backend, built as `CLASS(**kwargs)` from
  the query's `key=value` pairs (strings) updated with `options`. A Mooncake or
  Valkey-GLIDE backend is one file with one `StorageBackend` subclass implementing the
  methods above.
"""

from __future__ import annotations

import importlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl

from kvtier.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

Chunks = Sequence[memoryview | bytes]
# A key that is never written: what a probe of a store asks for.
PROBE_KEY = "kvtier-probe"


class StorageBackend(ABC):
    """A batched key-value store below the host tier; see the module docstring for the contract."""

    #: Short name for logs and metrics (`file`, `redis`, `redis+cluster`, or the class's).
    name: str = "custom"

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present."""

    @abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        """Read each key's value into its buffers; per key its length or -1 (absent, too long)."""

    @abstractmethod
    def put(self, keys: Sequence[str], values: Sequence[Chunks]) -> list[bool]:
        """Store each value (its chunks in order) under its key; per key whether it was stored."""

    def discard(self, keys: Sequence[str]) -> bool | None:
        """Delete the values of `keys` (absent ones are no error); False where it cannot: the default
        deletes nothing and logs so once (see the module docstring)."""
        if not getattr(self, "_told_no_discard", False):
            self._told_no_discard = True
            log.warning(
                "storage backend %s cannot delete a refused value (no discard): the next store of its "
                "page writes over it instead",
                self.name,
            )
        return False

    def reachable(self) -> bool:
        """Whether the store answers now (see the module docstring); the default cannot tell: True."""
        return True

    def usage(self) -> tuple[int, int] | None:
        """`(values, bytes)` held now, or None where the backend cannot tell cheaply."""
        return None

    def close(self) -> None:  # noqa: B027 (optional: most backends hold something to release)
        """Release connections and files (idempotent)."""

    def describe(self) -> str:
        return self.name

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ValueBuffers(list):
    """The buffers one value is read into (a list of memoryviews), and where the value came from.

    `source`: `(backend, key)`, named by a backend's `get_into` (`note_source`) where it found
    the value and can delete it; `discard()` deletes it (a fault is logged, never raised: the
    read is a miss either way) and `discarded` says whether the value is gone (None: no
    deletion asked). A plain list of buffers works too; nothing is recorded for it.
    """

    source: tuple[StorageBackend, str] | None = None
    discarded: bool | None = None

    def discard(self) -> bool:
        """Delete the value read into these buffers from its backend; whether a deletion was asked."""
        if self.source is None:
            return False
        backend, key = self.source
        self.source = None
        self.discarded = False
        try:
            self.discarded = backend.discard([key]) is not False
        except Exception as e:
            log.warning(
                "storage %s: deleting the refused value %s failed (%s: %s)",
                backend.name,
                key,
                type(e).__name__,
                e,
            )
        return True


def note_source(buffers: Sequence[memoryview], backend: StorageBackend, key: str) -> None:
    """Name where the value read into `buffers` came from (a value found, however long), where they
    are `ValueBuffers`."""
    if isinstance(buffers, ValueBuffers):
        buffers.source = (backend, key)


# What a key may be: the file backend makes it a file name, so `/` and the like are out.
KEY = re.compile(r"[A-Za-z0-9._-]{1,200}")


def check_keys(keys: Sequence[str]) -> None:
    """`StorageError` unless every key is 1-200 of `[A-Za-z0-9._-]` and not `.` or `..`."""
    bad = [k for k in keys if not (isinstance(k, str) and KEY.fullmatch(k)) or k in (".", "..")]
    if bad:
        raise StorageError(f"storage keys must be 1-200 of [A-Za-z0-9._-], not '.' or '..': {bad[:4]!r}")


def byte_views(chunks: Chunks, writable: bool = False) -> list[memoryview]:
    """Each chunk as a flat byte view; `StorageError` for one not C-contiguous (or read-only)."""
    try:
        views = [memoryview(c).cast("B") for c in chunks]
    except (TypeError, ValueError) as e:
        raise StorageError(f"storage buffers must be C-contiguous: {e}") from e
    if writable and any(v.readonly for v in views):
        raise StorageError("storage get_into: every destination buffer must be writable")
    return views


_PLUGIN = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)(?:\?(.*))?$")


def open_backend(url: str, **options: Any) -> StorageBackend:
    """The backend `url` names (see the module docstring); `ConfigError` for an unknown one."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"storage URL must be a non-empty string, got {url!r}")
    scheme = url.split("://", 1)[0] if "://" in url else None
    if scheme == "file":
        from kvtier.storage.file import FileBackend

        return FileBackend(url[len("file://") :], **options)
    if scheme in ("redis", "redis+cluster"):
        from kvtier.storage.redis import RedisBackend

        return RedisBackend(url, **options)
    if scheme is None and (m := _PLUGIN.match(url)):
        return _plugin(m.group(1), m.group(2), m.group(3) or "", options)
    raise ConfigError(
        f"storage URL {url!r}: use file://PATH, redis://HOST:PORT[/DB], "
        "redis+cluster://HOST:PORT[,HOST:PORT...] or MODULE:CLASS[?key=value]"
    )


def _plugin(module: str, cls: str, query: str, options: dict[str, Any]) -> StorageBackend:
    try:
        kind = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"storage backend {module}:{cls} cannot be loaded: {e}") from e
    if not (isinstance(kind, type) and issubclass(kind, StorageBackend)):
        raise ConfigError(f"storage backend {module}:{cls} is not a kvtier.storage.StorageBackend")
    return kind(**{**dict(parse_qsl(query)), **options})


def check_url(url: str) -> None:
    """Refuse now what `open_backend(url)` would refuse later for its place: a `file://` directory that
    cannot be made or written (`ConfigError`, `StorageError`); the other schemes' URLs are checked when
    parsed. Creates the directory, as the backend would; reads nothing."""
    if isinstance(url, str) and url.startswith("file://"):
        from kvtier.storage.file import usable_root

        usable_root(url[len("file://") :])


def probe(backend: StorageBackend) -> str | None:
    """Ask `backend` once whether it holds `PROBE_KEY`: None when it answered, else why not (one line)."""
    try:
        backend.exists([PROBE_KEY])
    except Exception as e:
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None
