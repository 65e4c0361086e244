"""Real `redis-server` processes for tests: standalone servers and a 3-master cluster on loopback.

Each server runs in its own directory with persistence off, on a free loopback port, and is
stopped by its PID. `.ci/redis.sh` does the same for CI and exports the URLs; the fixtures
in `conftest.py` use those when they are set.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

STANDALONE_ENV = "KVTIER_TEST_REDIS_URL"
CLUSTER_ENV = "KVTIER_TEST_REDIS_CLUSTER_URL"


def have_redis() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """`redis-cli -p PORT ARGS...`'s output (stdout and stderr)."""
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout + out.stderr


def _wait(what: str, ready, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout} s")
        time.sleep(0.05)


@dataclass
class RedisServer:
    """One `redis-server` process on `port` with its own `dir`; `restart()` reuses both."""

    dir: Path
    port: int = field(default_factory=free_port)
    cluster_port: int | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir)]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"]
        if self.cluster_port is not None:
            args += ["--cluster-enabled", "yes", "--cluster-port", str(self.cluster_port)]
            args += ["--cluster-config-file", str(self.dir / "nodes.conf")]
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        _wait(f"redis-server on port {self.port}", lambda: self._alive() and "PONG" in cli(self.port, "ping"))
        return self

    def _alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            tail = (self.dir / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server on port {self.port} exited: {tail}")
        return True

    def kill(self) -> None:
        """SIGKILL by PID and reap; the port is free once this returns."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM by PID (SIGKILL if it lingers) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()


@dataclass
class RedisClusterServers:
    """Three masters with no replicas, their slots assigned, `cluster_state:ok` on each."""

    servers: list[RedisServer]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    @classmethod
    def start(cls, base: Path, masters: int = 3) -> RedisClusterServers:
        servers = [RedisServer(base / f"node{i}", cluster_port=free_port()) for i in range(masters)]
        self = cls(servers)
        try:
            for s in servers:
                s.start()
            nodes = [f"127.0.0.1:{s.port}" for s in servers]
            create = ["--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
            out = cli(servers[0].port, *create)
            if "[OK]" not in out:
                raise RuntimeError(f"redis-cli --cluster create failed: {out[-2000:]}")
            for s in servers:
                ok = lambda s=s: "cluster_state:ok" in cli(s.port, "cluster", "info")  # noqa: E731
                _wait(f"cluster node {s.port}", ok)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
