"""`RedisBackend`: values as Redis strings, one key per value, on a server or a Redis Cluster.

URLs (validated by the constructor, which connects to nothing):

- `redis://[USER:PASSWORD@]HOST[:PORT][/DB]`: one server (`name` "redis"), a
  `BlockingConnectionPool` of `pool_size` connections (a caller waits up to `timeout_s`
  for a free one).
- `redis+cluster://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]`: a Redis Cluster found
  from those nodes (`name` "redis+cluster"), `pool_size` connections per node; no DB.
  The client is built, and the cluster's slots fetched, on the first call.

HOST may be an IPv6 address in brackets; PORT defaults to 6379.

Contract (beyond `kvtier.storage.backend`):

- Each batch is one non-transactional pipeline (`EXISTS`, `GET` or `SET` per key); on a
  cluster the pipeline is split by node. `SET` carries `EX ttl_s` when `ttl_s > 0`.
  A command that fails alone (an out-of-memory `SET`, a key of another type) is that
  key's miss or unstored write; the batch goes on.
- Values are copied from the reply into the caller's buffers (redis-py hands back
  `bytes`); a put of several chunks joins them once.
- A server that cannot be reached (refused, timed out, cluster down) makes the call raise
  `StorageError` and starts a back-off: for `BACKOFF_FIRST_S`, doubling on each further
  failure up to `BACKOFF_MAX_S`, every call raises `StorageError` at once without
  touching the network; the first call after it tries again, and a success resets it.
  redis-py reconnects by itself once the server is back. Every other redis-py error is
  raised as `StorageError` too (from it), without a back-off.
- `reachable()`: False from a call that could not reach the server until one succeeds;
  asked while failing after the back-off, it tries the server itself (one `EXISTS`).
- Keys as `kvtier.storage.backend.check_keys` allows; `usage()` is None (a shared server's
  contents are not this process's to count).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    MaxConnectionsError,
    RedisClusterException,
    RedisError,
    TimeoutError,
)
from redis.retry import Retry

from kvtier.errors import ClosedError, ConfigError, StorageError
from kvtier.storage.backend import PROBE_KEY, Chunks, StorageBackend, byte_views, check_keys, note_source

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 10.0
# Errors that say the server (or the cluster) cannot be reached now.
_UNREACHABLE = (ConnectionError, TimeoutError, ClusterDownError, RedisClusterException)


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis URL points: its nodes, DB and credentials."""

    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None

    def describe(self) -> str:
        scheme = "redis+cluster" if self.cluster else "redis"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_redis_url(url: str) -> RedisTarget:
    """The target of a `redis://` or `redis+cluster://` URL; `ConfigError` for a malformed one."""
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    if not sep or scheme not in ("redis", "redis+cluster"):
        raise ConfigError(f"Redis URL {url!r}: use redis://HOST:PORT[/DB] or redis+cluster://HOST:PORT,...")
    cluster = scheme == "redis+cluster"
    if "?" in rest or "#" in rest:
        raise ConfigError(f"Redis URL {url!r}: no query or fragment (pass options as arguments)")
    userinfo, _, rest = rest.rpartition("@")
    username, _, password = userinfo.partition(":")
    hosts, slash, path = rest.partition("/")
    db = 0
    if cluster and path:
        raise ConfigError(f"Redis Cluster URL {url!r}: a cluster has no DB (remove /{path})")
    if slash and path:
        if not path.isdigit() or int(path) > 1 << 16:
            raise ConfigError(f"Redis URL {url!r}: DB must be a number, got {path!r}")
        db = int(path)
    nodes = tuple(_node(url, text) for text in hosts.split(","))
    if not cluster and len(nodes) != 1:
        raise ConfigError(f"Redis URL {url!r}: one HOST:PORT (several nodes need redis+cluster://)")
    return RedisTarget(cluster, nodes, db, username or None, password or None)


def _node(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, tail = text[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ConfigError(f"Redis URL {url!r}: bad node {text!r}")
        port = tail[1:] if tail else "6379"
    else:
        host, _, port = text.partition(":") if text.count(":") <= 1 else ("", "", "")
        port = port if ":" in text else "6379"
    if not host or any(c in host for c in " /@[]"):
        raise ConfigError(f"Redis URL {url!r}: node {text!r} has no valid host")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"Redis URL {url!r}: node {text!r} needs a port in 1-65535")
    return host, int(port)


class _Backoff:
    """After a failure to reach the server, refuse calls for a while, doubling while it fails."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delay = 0.0
        self._until = 0.0
        self._cause = ""

    def check(self, where: str) -> None:
        with self._lock:
            left = self._until - time.monotonic()
            if left > 0:
                raise StorageError(f"{where} unreachable ({self._cause}); next try in {left:.1f} s")

    @property
    def failing(self) -> bool:
        """Whether the last call failed to reach the server (and none has succeeded since)."""
        return self._delay > 0

    @property
    def due(self) -> bool:
        """Whether the back-off has passed: the next call tries the server again."""
        return time.monotonic() >= self._until

    def failed(self, where: str, e: BaseException) -> None:
        with self._lock:
            if self._delay == 0:  # info: the storage tier's callers warn, once per operation and while
                log.info("%s unreachable, failing fast for %.1f s: %s", where, BACKOFF_FIRST_S, e)
            self._delay = min(BACKOFF_MAX_S, self._delay * 2) if self._delay else BACKOFF_FIRST_S
            self._until = time.monotonic() + self._delay
            self._cause = f"{type(e).__name__}: {e}"

    def succeeded(self, where: str) -> None:
        if self._delay:
            with self._lock:
                if self._delay:
                    log.info("%s reachable again", where)
                self._delay, self._until = 0.0, 0.0


class RedisBackend(StorageBackend):
    """Values in Redis or a Redis Cluster; see the module docstring for URLs and contract."""

    def __init__(self, url: str, pool_size: int = 16, ttl_s: int = 0, timeout_s: float = 5.0) -> None:
        self.target = parse_redis_url(url)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigError(f"Redis storage: pool_size must be an int >= 1, got {pool_size!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 0:
            raise ConfigError(f"Redis storage: ttl_s must be an int >= 0 (seconds), got {ttl_s!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"Redis storage: timeout_s must be a positive number, got {timeout_s!r}")
        self.name = "redis+cluster" if self.target.cluster else "redis"
        self.pool_size, self.ttl_s, self.timeout_s = pool_size, ttl_s, float(timeout_s)
        self._where = self.target.describe()
        self._backoff = _Backoff()
        self._lock = threading.Lock()
        self._redis: redis.Redis | RedisCluster | None = None
        self._pool: redis.BlockingConnectionPool | None = None
        self._closed = False
        if not self.target.cluster:
            self._redis = redis.Redis(connection_pool=self._standalone_pool())

    def describe(self) -> str:
        return self._where

    # -- the interface --------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        found = self._pipeline(lambda p: [p.exists(k) for k in keys])
        for n, hit in enumerate(found):
            if hit != 1:
                return n
        return len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        check_keys(keys)
        if len(buffers) != len(keys):
            raise StorageError(f"{self._where}: {len(keys)} keys but {len(buffers)} buffer lists")
        views = [byte_views(b, writable=True) for b in buffers]
        values = self._pipeline(lambda p: [p.get(k) for k in keys])
        for key, b, v in zip(keys, buffers, values, strict=True):
            if isinstance(v, bytes):  # found: a -1 below is a value too long, to be discarded
                note_source(b, self, key)
        return [_scatter(v, dest) for v, dest in zip(values, views, strict=True)]

    def put(self, keys: Sequence[str], values: Sequence[Chunks]) -> list[bool]:
        check_keys(keys)
        if len(values) != len(keys):
            raise StorageError(f"{self._where}: {len(keys)} keys but {len(values)} values")
        blobs = [_joined(byte_views(v)) for v in values]
        ex = self.ttl_s or None
        done = self._pipeline(lambda p: [p.set(k, b, ex=ex) for k, b in zip(keys, blobs, strict=True)])
        return [d is True for d in done]

    def reachable(self) -> bool:
        """False while the server cannot be reached; once the back-off has passed, one `EXISTS` tries it."""
        if self._backoff.failing and self._backoff.due:
            with contextlib.suppress(StorageError):  # the back-off records the outcome
                self._pipeline(lambda p: [p.exists(PROBE_KEY)])
        return not self._backoff.failing

    def discard(self, keys: Sequence[str]) -> bool:
        """Delete the keys (a reader refused their values)."""
        check_keys(keys)
        self._pipeline(lambda p: [p.delete(k) for k in keys])
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, pool = self._redis, self._pool
            self._redis = self._pool = None
        if client is not None:
            client.close()
        if pool is not None:
            pool.disconnect()

    # -- the connection -------------------------------------------------------------------

    def _standalone_pool(self) -> redis.BlockingConnectionPool:
        (host, port), t = self.target.nodes[0], self.target
        self._pool = redis.BlockingConnectionPool(
            host=host,
            port=port,
            db=t.db,
            username=t.username,
            password=t.password,
            max_connections=self.pool_size,
            timeout=self.timeout_s,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return self._pool

    def _client(self) -> redis.Redis | RedisCluster:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._where} used after close()")
            if self._redis is None:
                self._redis = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.target.nodes],
                    username=self.target.username,
                    password=self.target.password,
                    max_connections=self.pool_size,
                    socket_timeout=self.timeout_s,
                    socket_connect_timeout=self.timeout_s,
                    require_full_coverage=False,
                    # One immediate retry after a topology refresh; waiting is the back-off's job.
                    retry=Retry(NoBackoff(), 1),
                )
            return self._redis

    def _pipeline(self, queue: Callable[[Any], object]) -> list[Any]:
        """Run the commands `queue` adds to a fresh pipeline; per command its reply or error."""
        self._backoff.check(self._where)
        try:
            pipe = self._client().pipeline(transaction=False)
            queue(pipe)
            replies = pipe.execute(raise_on_error=False)
            down = next((r for r in replies if _unreachable(r)), None)
            if down is not None:
                raise down
        except (RedisError, RedisClusterException) as e:
            if _unreachable(e):
                self._backoff.failed(self._where, e)
            raise StorageError(f"{self._where}: {type(e).__name__}: {e}") from e
        self._backoff.succeeded(self._where)
        return replies


def _unreachable(e: object) -> bool:
    return isinstance(e, _UNREACHABLE) and not isinstance(e, MaxConnectionsError)


def _scatter(value: object, views: list[memoryview]) -> int:
    """Copy `value` into `views` from the start; its length, or -1 (absent, failed, too long)."""
    if not isinstance(value, bytes) or len(value) > sum(len(v) for v in views):
        return -1
    src, off = memoryview(value), 0
    for v in views:
        n = min(len(v), len(value) - off)
        if n <= 0:
            break
        v[:n] = src[off : off + n]
        off += n
    return len(value)


def _joined(views: list[memoryview]) -> bytes | memoryview:
    return views[0] if len(views) == 1 else b"".join(views)
