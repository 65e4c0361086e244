"""`FileBackend`: values as files under a directory, sharded, written atomically, LRU-capped.

On disk: the value of key `K` is the file `ROOT/ab/cd/K`, where `abcd` are the first four
hex digits of `xxh64(K)`: two levels of 256 directories, created when first written, so no
directory holds more than a few files per 65536 values. Nothing else lives in the shard
directories except temporary files, whose names contain `~` (a key never does).

Contract (beyond `kvtier.storage.backend`):

- `put` writes each value to a temporary file of its own (pid, thread, counter) in the
  key's directory, then `os.replace`s it onto the key's name: a reader sees the old value
  or the new one whole, and two writers of one key (threads or processes) leave one of
  their values whole. A write that fails (a full disk, any `OSError`) stores nothing,
  removes its temporary file and answers False for that key only; values are not
  fsynced (a value torn by a power loss fails the checksum `kvtier.storage.values`
  keeps, and is a miss).
- Keys: `[A-Za-z0-9._-]`, 1-200 characters, not `.` or `..`; any other raises
  `StorageError` before anything is written.
- `size_bytes` (0 = no cap): an index in memory (key -> size, least recently used first)
  and the total of its sizes. A put or a hit moves its key last; after a put the oldest
  values are unlinked until the total is at most the cap, each step O(1), never a scan.
  A value larger than the cap is not written (dropped). Values another process wrote
  into the same directory join the index when `exists` or `get_into` finds them; each
  process keeps its own cap over what it knows.
- Restart: the constructor scans the shard directories once (time linear in the files),
  indexes every value oldest first by mtime and removes temporary files older than
  `STALE_TEMP_S` (a writer still alive is never that slow).
- Counters (plain ints, read without a lock): `evicted_values`, `evicted_bytes`,
  `dropped_values`, `dropped_bytes`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from kvtier.errors import ClosedError, ConfigError, StorageError
from kvtier.storage.backend import KEY, Chunks, StorageBackend, byte_views, check_keys, note_source

log = logging.getLogger(__name__)

_TEMP_MARK = "~"
# A temporary file older than this belongs to a writer that died.
STALE_TEMP_S = 600.0
_IOV_MAX = 512


class FileBackend(StorageBackend):
    """Values as files under `path`; see the module docstring for layout and contract."""

    name = "file"

    def __init__(self, path: str, size_bytes: int = 0) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"file storage: path must be a non-empty string, got {path!r}")
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise ConfigError(f"file storage: size_bytes must be an int >= 0, got {size_bytes!r}")
        self.root, self.size_bytes = usable_root(path), size_bytes
        self.evicted_values = self.evicted_bytes = self.dropped_values = self.dropped_bytes = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._serial = itertools.count()
        self._closed = False
        self._rebuild()

    def describe(self) -> str:
        cap = f", cap {self.size_bytes} B" if self.size_bytes else ""
        return f"file://{self.root}{cap}"

    def path_of(self, key: str) -> str:
        """Where `key`'s value lives."""
        h = xxhash.xxh64_hexdigest(key.encode())
        return os.path.join(self.root, h[:2], h[2:4], key)

    # -- the interface --------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for n, key in enumerate(keys):
            try:
                size = os.stat(self.path_of(key)).st_size
            except FileNotFoundError:
                self._forget(key)
                return n
            except OSError as e:
                raise StorageError(f"file storage: stat of {key!r} failed: {e}") from e
            with self._lock:
                if key not in self._index:
                    self._insert(key, size)
                elif self._index[key] != size:  # rewritten by another process
                    self._bytes += size - self._index[key]
                    self._index[key] = size
        return len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        self._check_open()
        check_keys(keys)
        if len(buffers) != len(keys):
            raise StorageError(f"file storage: {len(keys)} keys but {len(buffers)} buffer lists")
        views = [byte_views(b, writable=True) for b in buffers]
        return [self._read(key, v, b) for key, v, b in zip(keys, views, buffers, strict=True)]

    def put(self, keys: Sequence[str], values: Sequence[Chunks]) -> list[bool]:
        self._check_open()
        check_keys(keys)
        if len(values) != len(keys):
            raise StorageError(f"file storage: {len(keys)} keys but {len(values)} values")
        views = [byte_views(v) for v in values]
        return [self._write(key, v) for key, v in zip(keys, views, strict=True)]

    def discard(self, keys: Sequence[str]) -> bool:
        """Unlink the keys' files (a reader refused their values)."""
        self._check_open()
        check_keys(keys)
        for key in keys:
            _unlink(self.path_of(key))
            self._forget(key)
        return True

    def reachable(self) -> bool:
        """Whether the directory is still there and writable."""
        return os.path.isdir(self.root) and os.access(self.root, os.W_OK | os.X_OK)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes

    def close(self) -> None:
        self._closed = True

    # -- one value ------------------------------------------------------------------------

    def _read(self, key: str, views: list[memoryview], buffers: Sequence[memoryview]) -> int:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)
            return -1
        except OSError as e:
            raise StorageError(f"file storage: open of {key!r} failed: {e}") from e
        note_source(buffers, self, key)  # found: a -1 below is a value too long, to be discarded
        capacity = sum(len(v) for v in views)
        try:
            # One byte past the buffers tells a longer value from one that fits exactly.
            n = os.preadv(fd, [*views, bytearray(1)], 0)
            while 0 < n < capacity:
                more = os.preadv(fd, _after(views, n), n)
                if more == 0:
                    break
                n += more
        except OSError as e:
            raise StorageError(f"file storage: read of {key!r} failed: {e}") from e
        finally:
            os.close(fd)
        if n > capacity:
            return -1
        with self._lock:
            self._insert(key, n)  # the newest now, at the size found (another process may have rewritten it)
        return n

    def _write(self, key: str, views: list[memoryview]) -> bool:
        size = sum(len(v) for v in views)
        if self.size_bytes and size > self.size_bytes:
            self._drop(key, size, f"{size} B is over the cap of {self.size_bytes} B")
            return False
        final = self.path_of(key)
        temp = f"{final}{_TEMP_MARK}{os.getpid()}-{threading.get_ident()}-{next(self._serial)}"
        try:
            fd = _create(temp)
            try:
                _write_all(fd, views)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(temp, final)
                self._insert(key, size)
        except OSError as e:
            _unlink(temp)
            self._drop(key, size, str(e))
            return False
        return True

    # -- the index (callers hold the lock where it says so) -------------------------------

    def _insert(self, key: str, size: int) -> None:
        """Index `key` as the most recent value and evict beyond the cap (lock held)."""
        self._bytes += size - self._index.pop(key, 0)
        self._index[key] = size
        while self.size_bytes and self._bytes > self.size_bytes:
            old, old_size = self._index.popitem(last=False)
            self._bytes -= old_size
            _unlink(self.path_of(old))
            self.evicted_values += 1
            self.evicted_bytes += old_size

    def _forget(self, key: str) -> None:
        """Unindex a value found missing (another process removed it)."""
        with self._lock:
            self._bytes -= self._index.pop(key, 0)

    def _drop(self, key: str, size: int, why: str) -> None:
        with self._lock:
            self.dropped_values += 1
            self.dropped_bytes += size
        log.debug("file storage: %s not stored (%d B): %s", key, size, why)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"file storage {self.root!r} used after close()")

    def _rebuild(self) -> None:
        """Index what the shard directories hold, oldest first; remove stale temporary files."""
        found: list[tuple[float, str, int]] = []
        stale = time.time() - STALE_TEMP_S
        removed = 0
        for leaf in (leaf for top in _subdirs(self.root) for leaf in _subdirs(top.path)):
            with os.scandir(leaf.path) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # another process removed it meanwhile
                        continue
                    if _TEMP_MARK in entry.name:
                        removed += _unlink(entry.path) if st.st_mtime < stale else 0
                    elif entry.is_file(follow_symlinks=False) and self._belongs(entry.name, leaf.path):
                        found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._insert(key, size)
            values, total = len(self._index), self._bytes
        log.info(
            "file storage %s: %d values, %d bytes found; %d stale temporary files removed",
            self.root,
            values,
            total,
            removed,
        )

    def _belongs(self, name: str, leaf: str) -> bool:
        return bool(KEY.fullmatch(name)) and os.path.dirname(self.path_of(name)) == leaf


def usable_root(path: str) -> str:
    """`path` as an absolute directory, made where missing; `ConfigError` for a file in its place,
    `StorageError` for one that cannot be made or written."""
    root = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"file storage: {root!r} exists and is not a directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StorageError(f"file storage: cannot create {root!r}: {e}") from e
    if not os.access(root, os.W_OK | os.X_OK):
        raise StorageError(f"file storage: {root!r} is not writable by this user")
    return root


def _subdirs(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return [e for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]


def _create(temp: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(temp, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(temp), exist_ok=True)
        return os.open(temp, flags, 0o644)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every view in order, resuming after short writes."""
    pending = [v for v in views if len(v)]
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        pending = _after(pending, n)


def _after(views: list[memoryview], n: int) -> list[memoryview]:
    """The views that remain once their first `n` bytes are consumed."""
    for i, v in enumerate(views):
        if n < len(v):
            return [v[n:], *views[i + 1 :]]
        n -= len(v)
    return []


def _unlink(path: str) -> int:
    """Remove `path` if it is there (1 if it was); a failure is logged, never raised."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as e:
        log.warning("file storage: cannot remove %s: %s", path, e)
        return 0
